"""The decode worker's ``PushLanding``: pushed KV reserved and written in its engine's own blocks, on the engine thread.

Every call becomes a command on the engine thread, so the block manager and the
KV cache keep one writer; the writes run between steps while the prefill
worker is still computing, instead of as one copy when the request's Decode
claims the KV. Commands run in order, so a push's writes are done before the
Decode that follows its confirmation adds the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.errors import EngineDeadError
from pdserve.engine.kv_handoff import KVLayout, KVReservation


class EngineLanding:
    """``kv_transfer.push_inbox.PushLanding`` over an ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def reserve(self, layout: KVLayout, first_block: int, end_block: int) -> KVReservation | None:
        call = asyncio.ensure_future(
            self.engine.call(lambda engine: engine.reserve_kv_blocks(layout, first_block, end_block))
        )
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            # The command runs anyway: whatever it reserves for a push that is gone goes back.
            call.add_done_callback(self._free_unclaimed)
            raise

    def write(self, reservation: KVReservation, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        self.engine.submit(lambda engine: engine.write_reserved_kv(reservation, layer, first_block, blocks))

    def free(self, reservation: KVReservation) -> None:
        if self.engine.is_alive:  # a dead engine's blocks are gone with it
            self.engine.submit(lambda engine: engine.free_kv_reservation(reservation))

    def after_writes(self, fn: Callable[[], None]) -> None:
        try:
            # Behind every write queued so far: commands run in order.
            self.engine.submit(lambda engine: fn())
        except EngineDeadError:
            fn()  # no write will ever run

    def _free_unclaimed(self, call: asyncio.Future[KVReservation | None]) -> None:
        if not call.cancelled() and call.exception() is None and call.result() is not None:
            self.free(call.result())
