"""KV pushed while the prefill runs: each layer's freshly written blocks handed out as soon as the layer is done.

A prefill engine whose request holds its KV with ``KVHoldParams(push=True)``
tells a ``KVPushSink`` (the prefill service's pusher) about every layer of the
request's blocks right after the model wrote them: a forward hook on each
decoder layer exports that layer's range of blocks (a copy, taken on the engine
thread between two layers, so nothing writes it meanwhile) and hands it over.
The transfer then runs while the later layers and chunks compute, and when the
first token is sampled only the last layer's piece is still on its way.

Which blocks a step pushes: after a chunk that does not end the prompt, the
full blocks it completed (a partial block is written again by the next chunk);
after the chunk that ends it, every block up to the end, the partial last one
too. Blocks found in the prefix cache go with the first chunk. Blocks before
the hold's ``push_first_block`` are never pushed (the receiver caches them). A
preempted request starts over from that block, and its recomputed pieces
replace the earlier ones at the receiver. The engine imports no transport: the
sink does the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pdserve.engine.kv.cache import KVCache
from pdserve.engine.sequence import Sequence

log = logging.getLogger(__name__)


class KVPushSink(Protocol):
    """Where a prefill engine hands the KV of the requests it pushes; called on the engine thread, must not block."""

    def push_layer(self, request_id: str, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        """Layer ``layer`` of blocks ``first_block``.. of the request: (1, 2, n, block_size, num_kv_heads, row_size),
        a copy the sink owns (on the engine's device)."""
        ...

    def push_end(self, request_id: str, complete: bool) -> None:
        """No more pieces come: ``complete`` when every block was pushed (the prefill finished), else it was aborted."""
        ...


class ScheduledChunk(Protocol):
    """One sequence's share of a step: ``num_new_tokens`` tokens from ``start`` (``scheduler.ScheduledSequence``)."""

    @property
    def seq(self) -> Sequence: ...

    @property
    def start(self) -> int: ...

    @property
    def num_new_tokens(self) -> int: ...


@dataclass(frozen=True)
class _Planned:
    request_id: str
    block_ids: tuple[int, ...]
    first_block: int
    end_block: int


class LayerPusher:
    """Pushes the KV of requests held with ``push=True``, layer by layer, during the steps that write it.

    ``sink`` is None until a service sets it; then ``begin_step`` (before the
    model runs) plans which blocks each pushing request gets this step, the
    layer hooks export them, ``end_step`` records the progress, and ``end``
    tells the sink that a request is done.
    """

    def __init__(self, layers: Seq[nn.Module], kv_cache: KVCache, block_size: int) -> None:
        self.sink: KVPushSink | None = None
        self._kv_cache = kv_cache
        self._block_size = block_size
        self._pushed: dict[str, int] = {}  # request id -> blocks pushed through every layer
        self._first: dict[str, int] = {}  # request id -> the first block it pushes
        self._plan: list[_Planned] = []
        self._layers = list(layers)
        # The layer hooks exist only during a step that pushes: a hooked model runs its layers one by one
        # (pdserve/engine/models/fused_decode.py), which the other steps need not.
        self._hooks: list[RemovableHandle] = []

    def begin_step(self, scheduled: Iterable[ScheduledChunk], preempted: Iterable[str]) -> None:
        """Plan what this step pushes: ``scheduled`` is the step's chunks, ``preempted`` the ids of the
        requests the scheduler preempted for it."""
        if self.sink is None:
            return
        for request_id in preempted:
            if request_id in self._pushed:
                self._pushed[request_id] = self._first[request_id]  # recomputed: push it all again
        for item in scheduled:
            seq = item.seq
            hold = seq.kv_hold
            if hold is None or not hold.push or item.start >= seq.num_prompt_tokens:
                continue
            end_token = item.start + item.num_new_tokens
            if end_token >= seq.num_prompt_tokens:
                end_block = -(-seq.num_prompt_tokens // self._block_size)
            else:
                end_block = end_token // self._block_size
            if seq.request_id not in self._pushed:
                # Never past the last block: the receiver needs the one holding the last prompt token.
                last_block = (seq.num_prompt_tokens - 1) // self._block_size
                self._first[seq.request_id] = self._pushed[seq.request_id] = min(hold.push_first_block, last_block)
            first_block = self._pushed[seq.request_id]
            if end_block > first_block:
                block_ids = tuple(seq.block_table[first_block:end_block])
                self._plan.append(_Planned(seq.request_id, block_ids, first_block, end_block))
        if self._plan and not self._hooks:
            self._hooks = [layer.register_forward_hook(self._hook(index)) for index, layer in enumerate(self._layers)]

    def end_step(self) -> None:
        for planned in self._plan:
            if planned.request_id in self._pushed:
                self._pushed[planned.request_id] = planned.end_block
        self._plan = []
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def end(self, request_id: str, complete: bool) -> None:
        """The request finished (``complete``) or was aborted: tell the sink, if it pushed."""
        self._first.pop(request_id, None)
        if self._pushed.pop(request_id, None) is None or self.sink is None:
            return
        self._plan = [planned for planned in self._plan if planned.request_id != request_id]
        try:
            self.sink.push_end(request_id, complete)
        except Exception:  # noqa: BLE001 - a sink's bug must not stop the engine for every request
            log.exception("KV push sink failed at the end of %s", request_id)

    def _hook(self, layer: int):  # noqa: ANN202 - a forward hook
        def after_layer(module: nn.Module, args: object, output: object) -> None:
            if not self._plan or self.sink is None:
                return
            for planned in self._plan:
                blocks = self._kv_cache.export_blocks(planned.block_ids, slice(layer, layer + 1))
                try:
                    self.sink.push_layer(planned.request_id, layer, planned.first_block, blocks)
                except Exception:  # noqa: BLE001 - see end(); the request falls back to a pull
                    log.exception("KV push sink failed for %s", planned.request_id)

        return after_layer
