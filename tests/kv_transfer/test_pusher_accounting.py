"""The pusher's count of queued bytes returns to zero however a push ends, also mid-piece.

CI once saw ``KVPusher._queued_bytes == -24576`` after a push dropped while a
piece was being sent: the drop released the piece's bytes, then the send
finished and released them again.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.engine.types.handoff import KVLayout
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.pusher import KVPusher

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
NUM_BLOCKS = 3


def _pusher(chunk_bytes: int) -> KVPusher:
    def no_stub(address: str):  # noqa: ANN202
        raise AssertionError(f"no stream is opened in this test ({address})")

    return KVPusher(TransferConfig(chunk_bytes=chunk_bytes), no_stub)


def _layer_blocks() -> torch.Tensor:
    return torch.randn(LAYOUT.tensor_shape(NUM_BLOCKS))[:1]  # one layer's pushed blocks


@pytest.mark.asyncio
async def test_a_push_stopped_while_a_piece_is_sent_counts_its_bytes_once() -> None:
    blocks = _layer_blocks()
    size = blocks.numel() * blocks.element_size()
    pusher = _pusher(chunk_bytes=size // 4)  # the piece goes out in 4 messages
    pusher.start("r", "127.0.0.1:1", "grpc", LAYOUT, NUM_BLOCKS)
    push = pusher._pushes["r"]
    push.opened = True  # its stream is this test's: _messages driven by hand, no PushKV call
    pusher.push_layer("r", 0, 0, blocks)  # on the engine thread in real use
    await asyncio.sleep(0)  # the piece reaches the push's queue
    assert pusher._queued_bytes == size
    messages = pusher._messages(push)
    assert (await anext(messages)).HasField("header")
    assert (await anext(messages)).piece.offset == 0  # mid-piece: 3 messages of it still to go
    pusher._stop_sending(push)  # dropped (the decode worker failed, or DropPush) meanwhile
    assert pusher._queued_bytes == 0
    offsets = [(await anext(messages)).piece.offset for _ in range(3)]
    assert offsets == [size // 4, size // 2, 3 * size // 4]
    # The generator finishes the piece and waits for the next one: nothing released twice.
    waiting = asyncio.ensure_future(anext(messages))
    await asyncio.sleep(0)
    assert not waiting.done()
    assert (pusher._queued_bytes, push.queued_bytes) == (0, 0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await messages.aclose()
    pusher.close()



@pytest.mark.asyncio
@pytest.mark.parametrize("finish_first", [False, True])
async def test_the_stream_ends_with_the_start_after_every_piece_whichever_comes_first(finish_first: bool) -> None:
    # The engine hands over its last piece and the end (push_end) on its thread; the service's
    # finish() queues the request's start from the event loop, possibly before them.
    from pdserve.protos.pdserve.v1.internal import worker_pb2

    pusher = _pusher(chunk_bytes=1 << 20)
    pusher.start("r", "127.0.0.1:1", "grpc", LAYOUT, NUM_BLOCKS)
    push = pusher._pushes["r"]
    push.opened = True  # its stream is this test's: _messages driven by hand, no PushKV call
    start = worker_pb2.KVPushStart(prompt_token_ids=[5, 6, 7])

    def announce() -> None:
        push.queue.put_nowait(start)  # what finish() queues before it waits for the confirmation

    if finish_first:
        announce()
    for layer in range(LAYOUT.num_layers):
        pusher.push_layer("r", layer, 0, _layer_blocks())
    pusher.push_end("r", complete=True)
    if not finish_first:
        await asyncio.sleep(0)  # the engine's pieces and end reach the queue first
        announce()
    kinds = [(message.WhichOneof("kind"), message) async for message in pusher._messages(push)]
    assert [kind for kind, _ in kinds] == ["header", "piece", "piece", "start"]
    assert [message.piece.layer for kind, message in kinds if kind == "piece"] == [0, 1]
    assert kinds[-1][1].start == start
    pusher.close()
