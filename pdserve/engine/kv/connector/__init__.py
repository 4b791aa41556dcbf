"""The decode side of a KV handoff, with one owner: a KV connector in the shape of vLLM v1's.

A request prefilled on another engine reaches a decode engine with a
``KVHandoff``; its prompt KV reaches it in one of two ways that fill the same
blocks:

- **pushed**: while the prefill worker computes, each layer's KV arrives here
  for blocks reserved as the push opens (``open_push``, ``write_push``); the
  push is ARRIVING until its last piece is written, then LANDED, and the
  request adopts the blocks when it is added (CLAIMED): nothing is copied then.
- **pulled**: the request waits for blocks (WAITING_FOR_REMOTE_KVS); once it
  has them, only the blocks neither the prefix cache nor a push filled are
  fetched from the prefill worker (``take_slots`` says which) and written
  (``fill``), or, if they cannot be had, the prompt is recomputed here.

The connector has two parts, as vLLM's has: a scheduler side
(``ConnectorScheduler``: which requests wait for remote KV, how many blocks
they get, when they may run; ``PushTable``: the blocks pushes hold) and a
worker side (``ConnectorWorker``: receive, write, confirm). Anything a handoff
holds here that no request claims (a push whose Decode never comes) is
dropped at the engine's one handoff deadline (``EngineConfig.kv_handoff_timeout_s``),
the same one that bounds the prefill worker's lease (``pdserve.engine.kv.leases``) and
a decode worker's early start. Everything runs on the engine thread; the
services reach it through ``AsyncEngine`` commands. The connector is built from
``ConnectorParts`` (host.py): the engine's pool, block manager and scheduler
queue, and three calls back into the engine, never the engine itself.
"""

from __future__ import annotations

import torch

from pdserve.engine.kv.connector.host import ConnectorHost, ConnectorParts, DraftKV, RankImport, RemoteKVQueue
from pdserve.engine.kv.connector.pushes import PushedKV, PushRefused, PushState, PushTable
from pdserve.engine.kv.connector.scheduler_side import ConnectorScheduler
from pdserve.engine.kv.connector.worker_side import ConnectorWorker
from pdserve.engine.kv.handoff import KVFetch
from pdserve.engine.types.handoff import KVHandoff, KVLayout, KVSlot
from pdserve.engine.types.outputs import RequestOutput
from pdserve.engine.types.sampling_params import SamplingParams

__all__ = ["ConnectorHost", "ConnectorParts", "ConnectorScheduler", "ConnectorWorker", "DecodeKVConnector", "DraftKV",
           "PushRefused", "PushState", "PushedKV", "PushTable", "RankImport", "RemoteKVQueue"]


class DecodeKVConnector:
    """A decode engine's handoffs: the scheduler side and the worker side, and the calls the services make."""

    def __init__(self, parts: ConnectorParts) -> None:
        self._parts = parts
        self.pushes = PushTable(parts.block_manager, parts.kv_layout, parts.timeout_s)
        self.scheduler = ConnectorScheduler(parts, self.pushes)
        self.worker = ConnectorWorker(parts, self.pushes, self.scheduler)

    # ---- requests (scheduler side) ---------------------------------------------------------

    def add_remote_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                           handoff: KVHandoff, pushed: bool = False) -> str:
        """Queue a request whose prompt KV comes from another engine (WAITING_FOR_REMOTE_KVS); its id.
        ``pushed``: it adopts the push of its KV that landed here (see ``ConnectorScheduler``)."""
        self.scheduler.add_remote_request(request_id, prompt_token_ids, params, handoff, pushed)
        return request_id

    def take_slots(self) -> tuple[list[KVSlot], list[RequestOutput]]:
        return self.scheduler.take_slots()

    def drain_kv_slots(self) -> list[KVSlot]:
        """The requests that got their blocks since the last call, each with where its KV goes (every one:
        without ``take_slots``' joining of those whose blocks are filled already)."""
        return self._parts.queue.drain_kv_slots()

    def join_if_present(self, slot: KVSlot) -> RequestOutput | None:
        return self.scheduler.join_if_present(slot)

    def recompute(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.recompute(request_id)

    # ---- KV (worker side) ------------------------------------------------------------------

    def fill(self, request_id: str, first_block: int, blocks: torch.Tensor | KVFetch) -> RequestOutput | None:
        return self.worker.fill(request_id, first_block, blocks)

    def fill_draft(self, request_id: str, blocks: torch.Tensor) -> bool:
        return self.worker.fill_draft(request_id, blocks)

    def accepts_draft_kv(self, handoff: KVHandoff) -> bool:
        return self.scheduler.accepts_draft_kv(handoff)

    def open_push(self, request_id: str, layout: KVLayout, first_block: int, num_blocks: int,
                  max_bytes: int = 1 << 62) -> PushedKV:
        """Reserve blocks for a push (``PushTable.open``); a tensor-parallel engine takes none (each rank
        fetches its own heads)."""
        if self._parts.import_on_ranks is not None:
            raise ValueError("this engine is tensor-parallel: each rank fetches its own heads, a push cannot land")
        return self.pushes.open(request_id, layout, first_block, num_blocks, max_bytes)

    def write_push(self, entry: PushedKV, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        self.worker.write_push(entry, layer, first_block, blocks)

    def drop_push(self, request_id: str, entry: PushedKV | None = None, refuse_later: bool = False) -> None:
        self.pushes.drop(request_id, entry, refuse_later)

    def pushes_landed_since(self, since: float) -> int:
        """Pushes landed at or after ``since`` (``time.monotonic``) whose requests have not been added yet:
        their starts are on the way (``BatchWindow`` holds a step briefly for them)."""
        return self.pushes.landed_since(since)

    # ---- the engine's own bookkeeping ------------------------------------------------------

    def request_finished(self, request_id: str) -> None:
        self.scheduler.request_finished(request_id)

    def expire(self) -> list[str]:
        """Drop what no request claimed before the handoff deadline; the pushes' request ids."""
        return self.pushes.expire()

    def close(self) -> None:
        self.pushes.drop_all()
