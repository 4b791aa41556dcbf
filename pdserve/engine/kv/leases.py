"""The one owner of KV held for a handoff: a finished request's blocks, pinned until released or expired.

A prefill engine finishes a request with ``KVHoldParams`` by handing its
sequence here instead of freeing its blocks. From then on nothing else knows
the request: the lease ends on ``release`` (the decode side took the KV, or the
first token ended the request), on ``expire`` (nobody came within the engine's
handoff deadline, ``EngineConfig.kv_handoff_timeout_s``) or on
``release_all`` (shutdown), and each frees the blocks through the block
manager. Everything but ``export`` runs on the engine thread.

``export`` is the ``kv_transfer.KVSource`` the prefill service hands its
transports: they copy held blocks from their own threads, without queueing
behind a step (a prefill step takes seconds). That is safe because held blocks
are pinned (never reallocated, never written), and the lock keeps a lease from
ending while a copy runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVCache
from pdserve.engine.sequence import Sequence
from pdserve.engine.types.handoff import DRAFT_SECTION_SUFFIX, KVHandoff


@dataclass(frozen=True)
class _Lease:
    seq: Sequence
    handoff: KVHandoff
    expires_at: float  # time.monotonic()


class LeaseTable:
    """Held requests by id; ``grant`` takes a finished sequence's blocks for ``timeout_s`` seconds,
    ``release``/``expire`` free them."""

    def __init__(
        self,
        block_manager: BlockManager,
        kv_cache: KVCache,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        draft_kv_cache: KVCache | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._block_manager = block_manager
        self._kv_cache = kv_cache
        # A draft model's pool parallel to ``kv_cache`` (same block ids), when this engine
        # hands the draft's prompt KV over too: exported as ``<request id>#draft``.
        self._draft_kv_cache = draft_kv_cache
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self.num_expired = 0
        # Told the id of every lease that ends, on the engine thread (the prefill
        # service frees what its transports staged for it).
        self.on_end: Callable[[str], None] | None = None

    # ---- engine thread -------------------------------------------------------------

    def grant(self, seq: Sequence, handoff: KVHandoff, claim_deadline: float | None = None) -> None:
        """Hold ``seq``'s blocks (already pinned: its finish did not free them) until released or expired:
        ``timeout_s`` from now, or at ``claim_deadline`` (this table's clock) when that comes first."""
        expires_at = self._clock() + self.timeout_s
        if claim_deadline is not None:
            expires_at = min(expires_at, claim_deadline)
        lease = _Lease(seq, handoff, expires_at)
        with self._lock:
            self._leases[seq.request_id] = lease

    def release(self, request_id: str) -> bool:
        """End a lease now and free its blocks; False if ``request_id`` holds none (idempotent)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self._end(lease)
        return True

    def expire(self) -> list[str]:
        """End every lease past its deadline; returns their ids."""
        now = self._clock()
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in expired:
                del self._leases[lease.seq.request_id]
        for lease in expired:
            self.num_expired += 1
            self._end(lease)
        return [lease.seq.request_id for lease in expired]

    def release_all(self) -> None:
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            self._end(lease)

    # ---- any thread ----------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self._kv_cache.num_layers

    def num_layers_of(self, request_id: str) -> int:
        """Layers of what ``export(request_id, ...)`` returns: the draft's for a draft section."""
        return self._cache_of(request_id)[1].num_layers

    def export(
        self, request_id: str, first_block: int, layers: slice = slice(None), heads: range | None = None
    ) -> torch.Tensor:
        """A copy of the held blocks from ``first_block`` on, of ``layers``:
        (num_layers, 2, n, block_size, num_kv_heads, head_dim); ``heads``: only these KV heads
        (global indices; under tensor parallelism gathered from the ranks that hold them).

        ``request_id`` + ``DRAFT_SECTION_SUFFIX`` exports the draft model's KV of
        the same blocks, when this engine built it. ``KeyError`` when ``request_id``
        holds nothing here (unknown, released, expired); ``ValueError`` when
        ``first_block`` is past its blocks.
        """
        held_id, kv_cache = self._cache_of(request_id)
        with self._lock:
            lease = self._leases.get(held_id)
            if lease is None:
                raise KeyError(f"request {request_id!r} holds no KV here (unknown, released or lease expired)")
            if kv_cache is not self._kv_cache and lease.handoff.draft_layout is None:
                raise KeyError(f"request {held_id!r} holds no draft KV here (its handoff has no draft section)")
            num_blocks = lease.handoff.num_blocks
            if not 0 <= first_block <= num_blocks:
                raise ValueError(f"first_block must be in [0, {num_blocks}], got {first_block}")
            if heads is not None:
                layout = lease.handoff.layout if kv_cache is self._kv_cache else lease.handoff.draft_layout
                layout.check_heads(heads)
            return kv_cache.export_blocks(lease.seq.block_table[first_block:num_blocks], layers, heads)

    def _cache_of(self, request_id: str) -> tuple[str, KVCache]:
        """The held request an exported id names, and the pool its blocks are read from."""
        if self._draft_kv_cache is not None and request_id.endswith(DRAFT_SECTION_SUFFIX):
            return request_id.removesuffix(DRAFT_SECTION_SUFFIX), self._draft_kv_cache
        return request_id, self._kv_cache

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._leases)

    # ---- internals -----------------------------------------------------------------

    def _end(self, lease: _Lease) -> None:
        self._block_manager.free(lease.seq)
        if self.on_end is not None:
            self.on_end(lease.seq.request_id)
            if lease.handoff.draft_layout is not None:
                self.on_end(lease.seq.request_id + DRAFT_SECTION_SUFFIX)
