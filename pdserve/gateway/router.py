"""Choosing the prefill and decode worker of each request.

Prefill: the worker with the least work before this prompt's first token —
tokens already queued there (uncached tokens only: a queued request that hits
the cache costs little) plus the prompt tokens it would have to compute, which
is the prompt minus the longest prefix it caches (per the Redis index).
A hot prefix therefore attracts traffic until its holder's queue costs more
than recomputing the prefix elsewhere. Decode: the fewest running sequences,
then the most free KV blocks.

LoRA: a request under an adapter hashes its blocks under the adapter (its
prefix hits are that adapter's), and a worker that does not hold the adapter
(its load report lists those it does) costs ``LORA_MISS_TOKENS`` more as a
prefill worker and ``LORA_MISS_RUNNING`` more sequences as a decode worker:
it would read the adapter from its folder first. Load and prefix hits still
outweigh that.

A worker publishes its new blocks to Redis a moment after it has computed
them; what this gateway has just had prefilled (``RecentPrefills``) counts at
once, so a request right behind another with the same prefix (the n choices of
one HTTP request, a chat's next turn) goes where the prefix is.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pdserve.cluster_index import PrefixIndexLookup
from pdserve.engine.types.hashing import BlockHash, adapter_model_id, hash_prompt_blocks
from pdserve.gateway.workers import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

# What reading a LoRA adapter on a worker that lacks it counts as: prompt tokens to compute (prefill), running
# sequences (decode). Reading one takes about as long as a short prompt's prefill (BENCHMARKS.md, lora_w1's swap).
LORA_MISS_TOKENS = 64
LORA_MISS_RUNNING = 2


def holds_adapter(worker: WorkerHandle, lora_name: str | None) -> bool:
    """Whether ``worker`` reported holding adapter ``lora_name`` (always, for the base model)."""
    return not lora_name or (worker.report is not None and lora_name in worker.report.lora_adapters)


@dataclass(frozen=True)
class PrefillChoice:
    worker: WorkerHandle
    expected_cached_tokens: int  # what the index says this worker holds of the prompt
    block_hashes: tuple[BlockHash, ...] = ()  # the prompt's full blocks (prefix routing only)
    queued_tokens: int = 0  # uncomputed prompt tokens queued there before this one (prefix routing only)


class RecentPrefills:
    """Prompt blocks this gateway has just had each worker prefill, for ``ttl_s`` (by then the index has them).

    A hint, as the Redis index is: the worker may evict the blocks meanwhile,
    which costs a misrouted request some recomputation, never a wrong answer.
    """

    def __init__(self, ttl_s: float = 10.0, max_blocks: int = 65536, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_blocks, self._clock = ttl_s, max_blocks, clock
        # (worker id, epoch, block hash) -> expiry, oldest first (the ttl is the same for all)
        self._expiry: OrderedDict[tuple[str, int, BlockHash], float] = OrderedDict()

    def add(self, worker_id: str, epoch: int, block_hashes: Sequence[BlockHash]) -> None:
        now = self._clock()
        for block_hash in block_hashes:
            key = (worker_id, epoch, block_hash)
            self._expiry.pop(key, None)
            self._expiry[key] = now + self.ttl_s
        while self._expiry and (len(self._expiry) > self.max_blocks or next(iter(self._expiry.values())) <= now):
            self._expiry.popitem(last=False)

    def longest_prefix(self, block_hashes: Sequence[BlockHash], live: Mapping[str, int]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each live worker (id -> epoch) was recently given."""
        now = self._clock()
        held = {}
        for worker_id, epoch in live.items():
            count = 0
            for block_hash in block_hashes:
                if self._expiry.get((worker_id, epoch, block_hash), 0.0) <= now:
                    break
                count += 1
            if count:
                held[worker_id] = count
        return held


class NoWorkerAvailable(RuntimeError):
    """No healthy worker of a role is known."""


class Router:
    """Load lives in the pool's handles; the router keeps round-robin turns and ``recent`` prefills."""

    POLICIES = ("prefix", "round_robin")

    def __init__(self, pool: WorkerPool, lookup: PrefixIndexLookup | None, policy: str = "prefix") -> None:
        if policy not in self.POLICIES:
            raise ValueError(f"routing policy must be one of {self.POLICIES}, got {policy!r}")
        self.pool = pool
        self.lookup = lookup
        self.policy = policy
        # One counter per choice: sharing one would make round-robin skip workers.
        self._prefill_turns = itertools.count()
        self._decode_turns = itertools.count()
        self.recent = RecentPrefills()

    async def choose_prefill(self, token_ids: list[int], exclude: set[str] = frozenset(),  # type: ignore[assignment]
                             lora_name: str | None = None) -> PrefillChoice:
        """``exclude``: addresses that just failed this request; ``lora_name``: its LoRA adapter (None: base)."""
        workers = [w for w in self.pool.healthy("prefill") if w.address not in exclude]
        if not workers:
            raise NoWorkerAvailable("no prefill worker is available")
        turn = next(self._prefill_turns)
        if self.policy == "round_robin":
            # The baseline prefix-aware routing is measured against: ignores caches and load.
            return PrefillChoice(workers[turn % len(workers)], 0)
        hashes, cached_blocks = await self._cached_blocks(workers, token_ids, lora_name=lora_name)
        best: tuple[tuple[int, int, int], WorkerHandle, int, int] | None = None
        for index, worker in enumerate(workers):
            block_size = worker.report.block_size if worker.report else 16
            # One token is always computed, so a full-prompt hit still leaves the last block.
            cached = min(cached_blocks.get(worker.worker_id, 0) * block_size, (len(token_ids) - 1) // block_size * block_size)
            queued = max(worker.inflight_tokens, worker.report.num_queued_tokens if worker.report else 0)
            cost = queued + len(token_ids) - cached + (0 if holds_adapter(worker, lora_name) else LORA_MISS_TOKENS)
            key = (cost, worker.inflight_requests, (index - turn) % len(workers))
            if best is None or key < best[0]:
                best = (key, worker, cached, queued)
        assert best is not None
        return PrefillChoice(best[1], best[2], tuple(hashes), best[3])

    def prefilled(self, choice: PrefillChoice) -> None:
        """``choice.worker`` has computed the prompt: its blocks are there now, whatever Redis says yet."""
        if choice.block_hashes:
            self.recent.add(choice.worker.worker_id, choice.worker.epoch, choice.block_hashes)

    async def decode_cached_tokens(self, worker: WorkerHandle, token_ids: list[int],
                                   block_hashes: Sequence[BlockHash] = (), lora_name: str | None = None) -> int:
        """What the index says decode ``worker`` caches of the prompt, in tokens (for a local prefill there).

        ``block_hashes``: the prompt's, when the prefill choice computed them already.
        """
        if self.policy != "prefix":
            return 0
        hashes, cached_blocks = await self._cached_blocks([worker], token_ids, block_hashes, lora_name)
        if not hashes:
            return 0
        block_size = worker.report.block_size if worker.report else 16
        # As for a prefill worker: one token is always computed.
        return min(cached_blocks.get(worker.worker_id, 0) * block_size, (len(token_ids) - 1) // block_size * block_size)

    def prefilled_locally(self, worker: WorkerHandle, block_hashes: Sequence[BlockHash]) -> None:
        """Decode ``worker`` has computed the prompt itself: its blocks are there now."""
        if block_hashes:
            self.recent.add(worker.worker_id, worker.epoch, block_hashes)

    def choose_decode(self, lora_name: str | None = None, exclude: set[str] = frozenset()) -> WorkerHandle:  # type: ignore[assignment]
        """``lora_name``: the request's LoRA adapter (None: the base model); ``exclude``: addresses that just
        failed this request."""
        workers = [w for w in self.pool.healthy("decode") if w.address not in exclude]
        if not workers:
            raise NoWorkerAvailable("no decode worker is available")
        turn = next(self._decode_turns)

        def key(item: tuple[int, WorkerHandle]) -> tuple[int, int, int]:
            index, worker = item
            running = max(worker.inflight_requests, worker.report.num_running if worker.report else 0)
            if not holds_adapter(worker, lora_name):
                running += LORA_MISS_RUNNING
            free = worker.report.num_free_blocks if worker.report else 0
            return (running, -free, (index - turn) % len(workers))

        return min(enumerate(workers), key=key)[1]

    async def _cached_blocks(
        self, workers: list[WorkerHandle], token_ids: list[int], block_hashes: Sequence[BlockHash] = (),
        lora_name: str | None = None,
    ) -> tuple[list[BlockHash], dict[str, int]]:
        """The prompt's block hashes, and the leading ones each worker holds (per the index and ``recent``)."""
        if self.lookup is None or not workers or workers[0].report is None:
            return [], {}
        report = workers[0].report
        model_id = adapter_model_id(report.model_id, lora_name)
        hashes = list(block_hashes) or hash_prompt_blocks(token_ids, report.block_size, model_id)
        if not hashes:
            return [], {}
        live = {w.worker_id: w.epoch for w in workers}
        cached = dict(await self.lookup.longest_prefix(hashes, live))
        for worker_id, blocks in self.recent.longest_prefix(hashes, live).items():
            cached[worker_id] = max(cached.get(worker_id, 0), blocks)
        return hashes, cached
