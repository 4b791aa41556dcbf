"""The decode worker's ``PushLanding``: pushed KV reserved and written by its engine's KV connector, on the engine thread.

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
from pdserve.engine.kv.connector import PushedKV
from pdserve.engine.types.errors import EngineDeadError
from pdserve.engine.types.handoff import KVLayout


class EngineLanding:
    """``pdserve.kv_transfer.push_inbox.PushLanding`` over an ``AsyncEngine``'s KV connector.

    ``max_bytes``: the most pushed KV the engine holds for requests whose Decode has not come yet;
    past it a push is refused (and pulled).
    """

    def __init__(self, engine: AsyncEngine, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.engine = engine
        self.max_bytes = max_bytes

    async def open(self, request_id: str, layout: KVLayout, first_block: int, num_blocks: int) -> PushedKV:
        max_bytes = self.max_bytes
        call = asyncio.ensure_future(self.engine.call(
            lambda engine: engine.kv_connector.open_push(request_id, layout, first_block, num_blocks, max_bytes)
        ))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            # The command runs anyway: whatever it reserves for a push that is gone goes back.
            call.add_done_callback(self._drop_unread)
            raise

    def write(self, push: PushedKV, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        self.engine.submit(lambda engine: engine.kv_connector.write_push(push, layer, first_block, blocks))

    def drop(self, push: PushedKV) -> None:
        if self.engine.is_alive:  # a dead engine's blocks are gone with it
            self.engine.submit(lambda engine: engine.kv_connector.drop_push(push.request_id, push))

    def after_writes(self, fn: Callable[[], None]) -> None:
        try:
            # Behind every write queued so far: commands run in order.
            self.engine.submit(lambda engine: fn())
        except EngineDeadError:
            fn()  # no write will ever run

    def _drop_unread(self, call: asyncio.Future[PushedKV]) -> None:
        if not call.cancelled() and call.exception() is None:
            self.drop(call.result())
