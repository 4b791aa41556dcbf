"""KV that crosses a tensor-parallel engine's edge: exporting held blocks' heads, importing a handoff per rank.

Export (the prefill side of a handoff): rank 0 serves the transports, so the
heads a receiver asks for are collected there: each asked-for head comes from
the lowest rank that holds it (a replicated head is sent once), every rank
sends rank 0 only its part, and rank 0 joins them along the head dimension.

Import (the decode side): each rank receives exactly the heads it owns, from
the sender, with the transport layer's fetcher; nothing goes through rank 0.
The ranks then agree (one all-reduce) on whether every rank got its part; if
one did not, the request is recomputed instead.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence

import torch

from pdserve.engine.kv.cache import KVCache
from pdserve.engine.kv.handoff import KVFetch
from pdserve.engine.parallel.ranks import FollowerRank, LeaderRanks
from pdserve.engine.parallel.sharding import kv_heads_of_rank
from pdserve.engine.parallel.step_codec import Command
from pdserve.engine.types.handoff import KVHandoff

logger = logging.getLogger(__name__)
_EXPORT_TAG = 7


def head_sources(num_kv_heads: int, tp: int, heads: range) -> list[tuple[int, range]]:
    """Which rank sends which (global) heads of ``heads``: the lowest rank holding each, in head order."""
    sources: list[tuple[int, range]] = []
    for rank in range(tp):
        own = kv_heads_of_rank(num_kv_heads, tp, rank)
        start, stop = max(own.start, heads.start), min(own.stop, heads.stop)
        if start >= stop:
            continue
        # Skip heads an earlier rank already sends (replicated heads).
        sent = sum(len(r) for _, r in sources if r.start <= start < r.stop)
        if sent:
            continue
        sources.append((rank, range(start, stop)))
    return sources


class ShardedKV:
    """Rank 0's view of every rank's KV pool, for the lease table: ``export_blocks`` of any global heads."""

    def __init__(self, local: KVCache, workers: LeaderRanks, num_kv_heads: int) -> None:
        self.local = local
        self.workers = workers
        self.num_kv_heads = num_kv_heads  # all ranks together

    @property
    def num_layers(self) -> int:
        return self.local.num_layers

    def export_blocks(
        self, block_ids: Sequence[int], layers: slice = slice(None), heads: range | None = None
    ) -> torch.Tensor:
        heads = range(self.num_kv_heads) if heads is None else heads
        tp = self.workers.world_size
        layer_range = range(self.local.num_layers)[layers]
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        parts: list[torch.Tensor] = []
        with self.workers.lock:
            self.workers.command([Command.EXPORT, len(ids), layer_range.start, layer_range.stop, heads.start, heads.stop])
            group = self.workers.group
            assert group is not None
            group.broadcast(ids)
            if self.local.layout is not None:  # the blocks' pages: the other ranks' pools are paged alike
                group.broadcast(torch.from_numpy(self.local.pages_of(block_ids)).contiguous())
            for rank, part in head_sources(self.num_kv_heads, tp, heads):
                own = kv_heads_of_rank(self.num_kv_heads, tp, rank)
                local_heads = range(part.start - own.start, part.stop - own.start)
                if rank == 0:
                    parts.append(self.local.export_blocks(block_ids, layers, local_heads))
                    continue
                shape = (len(layer_range), self.local.parts, len(ids), self.local.block_size, len(part),
                         self.local.block_shape[-1])
                buffer = torch.empty(shape, dtype=_wire_dtype(self.local), device=self.workers.comm_device)
                group.recv(buffer, rank, _EXPORT_TAG)
                parts.append(buffer)
        return parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts], dim=4)


def _wire_dtype(cache: KVCache) -> torch.dtype:
    return torch.int8 if cache.is_quantized else cache.dtype


def follower_export(follower: FollowerRank, header: torch.Tensor) -> None:
    """A follower's half of ``ShardedKV.export_blocks``: send rank 0 the asked-for heads it is the source of."""
    _, num_ids, layer_start, layer_stop, head_start, head_stop, _, _ = header.tolist()
    group = follower.group
    assert group is not None
    ids = torch.empty(num_ids, dtype=torch.long)
    group.broadcast(ids)
    kv_cache = follower.kv_cache
    if kv_cache.layout is not None:
        pages = torch.empty((num_ids, kv_cache.layout.num_groups), dtype=torch.long)
        group.broadcast(pages)
        kv_cache.page_map.update(ids.tolist(), pages.numpy())
    tp, total = follower.world_size, follower.total_kv_heads
    for rank, part in head_sources(total, tp, range(head_start, head_stop)):
        if rank != follower.rank:
            continue
        own = follower.kv_heads
        local_heads = range(part.start - own.start, part.stop - own.start)
        blocks = kv_cache.export_blocks(ids.tolist(), slice(layer_start, layer_stop), local_heads)
        group.send(blocks.to(follower.comm_device).contiguous(), 0, _EXPORT_TAG)


# ---- import: every rank fetches its own heads ---------------------------------------------------


def import_on_ranks(
    workers: LeaderRanks, local: KVCache, fetch: KVFetch, first_block: int, block_ids: Sequence[int]
) -> bool:
    """Land ``fetch`` on every rank (rank 0 from ``fetch.local_blocks``); True when every rank has its heads."""
    # The descriptor and the fetcher (a module-level function, pickled by reference) are small and cross once
    # per request: pickled, not worth a codec.
    # A paged pool's blocks travel with their pages (the other ranks' pools are paged alike).
    pages = local.pages_of(block_ids) if local.layout is not None else None
    message = pickle.dumps((fetch.handoff, fetch.fetcher, first_block, list(block_ids), pages))
    payload = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    with workers.lock:
        workers.command([Command.IMPORT, payload.numel()])
        group = workers.group
        assert group is not None
        group.broadcast(payload)
        ok = 1
        try:
            if block_ids:
                local.import_blocks(block_ids, fetch.local_blocks)
        except Exception:  # noqa: BLE001 - this rank's part failed: the request is recomputed
            logger.warning("rank 0 could not land its KV heads of %s", fetch.handoff.request_id, exc_info=True)
            ok = 0
        flags = torch.tensor([1 - ok], dtype=torch.long, device=workers.comm_device)
        group.all_reduce(flags)  # how many ranks failed
    return int(flags.item()) == 0


def follower_import(follower: FollowerRank, header: torch.Tensor) -> None:
    """A follower's part of an import: fetch its own heads from the sender, write them, report."""
    group = follower.group
    assert group is not None
    payload = torch.empty(int(header[1]), dtype=torch.uint8)
    group.broadcast(payload)
    handoff: KVHandoff
    handoff, fetcher, first_block, block_ids, pages = pickle.loads(payload.numpy().tobytes())
    failed = 0
    try:
        if pages is not None:
            follower.kv_cache.page_map.update(block_ids, pages)
        if block_ids:
            blocks = fetcher(handoff, first_block, follower.kv_heads)
            follower.kv_cache.import_blocks(block_ids, blocks)
    except Exception:  # noqa: BLE001 - reported through the all-reduce; rank 0 recomputes the request
        logger.warning("rank %d could not fetch its KV heads of %s", follower.rank, handoff.request_id, exc_info=True)
        failed = 1
    group.all_reduce(torch.tensor([failed], dtype=torch.long, device=follower.comm_device))
