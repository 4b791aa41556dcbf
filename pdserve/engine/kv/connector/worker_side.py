"""The decode connector's worker side: KV written into this engine's blocks, pushed or pulled.

Pushed KV arrives piece by piece (a layer of some blocks) while the prefill
worker computes, into blocks reserved for the push; the piece that completes
the last layer lands the push. Pulled KV arrives whole for a request that has
its blocks (``KVSlot``): only the blocks from ``first_block`` on; under tensor
parallelism a ``KVFetch`` lands rank 0's heads here while every other rank
fetches its own. A draft model's KV of the prompt may come along. Nothing here
decides who waits or runs: that is the scheduler side's.
"""

from __future__ import annotations

import torch

from pdserve.engine.kv.connector.host import ConnectorParts
from pdserve.engine.kv.connector.pushes import PushedKV, PushState, PushTable
from pdserve.engine.kv.connector.scheduler_side import ConnectorScheduler
from pdserve.engine.kv.handoff import KVFetch
from pdserve.engine.types.outputs import RequestOutput


class ConnectorWorker:
    """Receive, write, confirm: KV into the engine's pool (engine thread only)."""

    def __init__(self, parts: ConnectorParts, pushes: PushTable, scheduler_side: ConnectorScheduler) -> None:
        self._parts = parts
        self._pushes = pushes
        self._scheduler_side = scheduler_side

    def write_push(self, entry: PushedKV, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        """Write layer ``layer`` of the handoff's blocks ``first_block``.. ((1, 2, n, ...), any KV dtype) into
        the blocks reserved for ``entry``; the push lands with its last piece. A push dropped meanwhile (its
        blocks are not its own any more) is not written."""
        if entry.dropped or entry.state is PushState.BROKEN:
            return
        reservation = entry.reservation
        start = first_block - reservation.first_block
        block_ids = reservation.block_ids[start : start + blocks.shape[2]]
        if start < 0 or len(block_ids) != blocks.shape[2]:
            raise ValueError(f"blocks {first_block}+{blocks.shape[2]} are outside the reservation of blocks "
                             f"{reservation.first_block}..{reservation.end_block}")
        try:
            self._parts.kv_cache.import_blocks(block_ids, blocks, slice(layer, layer + 1))
        except BaseException:
            # Never a request decoding from half-written blocks: a claim drops a broken push.
            self._pushes.broken(entry)
            raise
        # Only the piece that ends the prompt writes its last block (earlier chunks push full blocks only),
        # and a push sends its layers in order: this was the push's last write.
        if layer == self._parts.kv_layout.num_layers - 1 and first_block + len(block_ids) == reservation.end_block:
            self._pushes.landed(entry)

    def fill(self, request_id: str, first_block: int, blocks: torch.Tensor | KVFetch) -> RequestOutput | None:
        """Write a remote request's pulled KV into its blocks and join it to the running batch.

        ``blocks``: the handoff's blocks from ``first_block`` (its ``KVSlot``) on,
        (num_layers, 2, n, block_size, num_kv_heads, row_size); under tensor
        parallelism a ``KVFetch`` instead (rank 0's heads, and how the other ranks
        fetch theirs; if one cannot, the prompt is recomputed here). Returns the
        state at landing (the first token and its text), or None when the request
        is no longer waiting for its KV (aborted): the KV is dropped.
        """
        seq = self._scheduler_side.receiving(request_id)
        if seq is None:
            return None
        parts = self._parts
        to_fill = seq.block_table[first_block:]
        local = blocks.local_blocks if isinstance(blocks, KVFetch) else blocks
        if local.shape[2] != len(to_fill):
            raise ValueError(f"KV for {request_id!r} has {local.shape[2]} blocks from block {first_block}, "
                             f"its slot has {len(to_fill)}")
        if isinstance(blocks, KVFetch) and parts.import_on_ranks is not None and to_fill:
            if not parts.import_on_ranks(parts.kv_cache, blocks, first_block, to_fill):
                return self._scheduler_side.recompute(request_id)
        elif to_fill:
            parts.kv_cache.import_blocks(to_fill, local)
        return self._scheduler_side.join_running(seq)

    def fill_draft(self, request_id: str, blocks: torch.Tensor) -> bool:
        """Write a remote request's draft-model KV (its handoff's draft section, from block 0) into the
        draft's pool, before ``fill``; False when the request no longer waits for its KV.

        Blocks the request shares through the prefix cache are rewritten with the
        draft's KV of the same tokens: draft KV only steers proposals (see
        ``pdserve.engine.spec_decode.draft_model``), so this is harmless to other sequences.
        """
        seq = self._scheduler_side.receiving(request_id)
        if seq is None:
            return False
        draft = self._parts.draft
        if draft is None or draft.kv_cache is None:
            raise ValueError("this engine has no draft model to take draft KV")
        if blocks.shape[2] != len(seq.block_table):
            raise ValueError(f"draft KV for {request_id!r} has {blocks.shape[2]} blocks, "
                             f"the request holds {len(seq.block_table)}")
        draft.kv_cache.import_blocks(seq.block_table, blocks)
        seq.num_draft_computed_tokens = seq.num_prompt_tokens
        return True
