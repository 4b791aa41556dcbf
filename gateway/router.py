"""Choosing the prefill and decode worker of each request.

Prefill: the worker with the least work before this prompt's first token —
tokens already queued there (uncached tokens only: a queued request that hits
the cache costs little) plus the prompt tokens it would have to compute, which
is the prompt minus the longest prefix it caches (per the Redis index).
A hot prefix therefore attracts traffic until its holder's queue costs more
than recomputing the prefix elsewhere. Decode: the fewest running sequences,
then the most free KV blocks.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from cluster_index import PrefixIndexLookup
from engine.hashing import hash_prompt_blocks
from gateway.workers import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillChoice:
    worker: WorkerHandle
    expected_cached_tokens: int  # what the index says this worker holds of the prompt


class NoWorkerAvailable(RuntimeError):
    """No healthy worker of a role is known."""


class Router:
    """Stateless apart from round-robin tie-breaking; load lives in the pool's handles."""

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

    async def choose_prefill(self, token_ids: list[int], exclude: set[str] = frozenset()) -> PrefillChoice:  # type: ignore[assignment]
        """``exclude``: addresses that just failed this request."""
        workers = [w for w in self.pool.healthy("prefill") if w.address not in exclude]
        if not workers:
            raise NoWorkerAvailable("no prefill worker is available")
        turn = next(self._prefill_turns)
        if self.policy == "round_robin":
            # The baseline prefix-aware routing is measured against: ignores caches and load.
            return PrefillChoice(workers[turn % len(workers)], 0)
        cached_blocks = await self._cached_blocks(workers, token_ids)
        best: tuple[tuple[int, int, int], WorkerHandle, int] | None = None
        for index, worker in enumerate(workers):
            block_size = worker.report.block_size if worker.report else 16
            # One token is always computed, so a full-prompt hit still leaves the last block.
            cached = min(cached_blocks.get(worker.worker_id, 0) * block_size, (len(token_ids) - 1) // block_size * block_size)
            queued = max(worker.inflight_tokens, worker.report.num_queued_tokens if worker.report else 0)
            cost = queued + len(token_ids) - cached
            key = (cost, worker.inflight_requests, (index - turn) % len(workers))
            if best is None or key < best[0]:
                best = (key, worker, cached)
        assert best is not None
        return PrefillChoice(best[1], best[2])

    def choose_decode(self) -> WorkerHandle:
        workers = self.pool.healthy("decode")
        if not workers:
            raise NoWorkerAvailable("no decode worker is available")
        turn = next(self._decode_turns)

        def key(item: tuple[int, WorkerHandle]) -> tuple[int, int, int]:
            index, worker = item
            running = max(worker.inflight_requests, worker.report.num_running if worker.report else 0)
            free = worker.report.num_free_blocks if worker.report else 0
            return (running, -free, (index - turn) % len(workers))

        return min(enumerate(workers), key=key)[1]

    async def _cached_blocks(self, workers: list[WorkerHandle], token_ids: list[int]) -> dict[str, int]:
        if self.lookup is None or not workers or workers[0].report is None:
            return {}
        report = workers[0].report
        hashes = hash_prompt_blocks(token_ids, report.block_size, report.model_id)
        if not hashes:
            return {}
        live = {w.worker_id: w.epoch for w in workers}
        return await self.lookup.longest_prefix(hashes, live)
