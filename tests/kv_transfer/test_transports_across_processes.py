"""Every CPU transport moves exactly the held blocks from a real sender process to this one.

The sender (``sender_process.py``) serves a deterministic source; the test
rebuilds the same tensors from the same seeds and demands ``torch.equal``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from collections.abc import Iterator

import grpc
import pytest
import torch

from pdserve.engine.kv.handoff import torch_dtype_of
from pdserve.kv_transfer import INTERNAL_GRPC_OPTIONS, MAX_CHUNK_BYTES, KVTransferError, TransferConfig, make_receiver
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from tests.kv_transfer.seeded_source import (
    BF16_REQUEST,
    BIG_REQUEST,
    INT8_REQUEST,
    LAYOUT,
    NUM_BLOCKS,
    SMALL_REQUEST,
    full_blocks,
    layout_of,
)
from tests.kv_transfer.sender_harness import SenderProcess, handoff, running_sender, shm_segments

CPU_TRANSPORTS = ("grpc", "shm", "torch_dist")
# Per test module run, so concurrent runs on one machine never see each other's segments.
SHM_PREFIX = f"pdserve_kv_test_{os.getpid()}_"
CONFIG = TransferConfig(shm_prefix=SHM_PREFIX, rpc_timeout_s=20.0, torch_dist_timeout_s=20.0)


@pytest.fixture(scope="module")
def sender() -> Iterator[SenderProcess]:
    with running_sender(SHM_PREFIX) as process:
        yield process


def _stub(channel: grpc.aio.Channel) -> worker_pb2_grpc.PrefillWorkerStub:
    return worker_pb2_grpc.PrefillWorkerStub(channel)


def _channel(sender: SenderProcess) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(sender.address, options=INTERNAL_GRPC_OPTIONS)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize(("request_id", "first_block"), [(SMALL_REQUEST, 0), (SMALL_REQUEST, 1), (BIG_REQUEST, 7)])
async def test_fetch_returns_exactly_the_held_blocks_from_first_block_on(
    sender: SenderProcess, transport: str, request_id: str, first_block: int
) -> None:
    receiver = make_receiver(transport, CONFIG)
    async with _channel(sender) as channel:
        blocks = await receiver.fetch(handoff(request_id, sender, transport), first_block, _stub(channel))
    await receiver.close()
    assert blocks.shape == LAYOUT.tensor_shape(NUM_BLOCKS[request_id] - first_block)
    assert torch.equal(blocks, full_blocks(request_id)[:, :, first_block:])


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("request_id", [BF16_REQUEST, INT8_REQUEST])
async def test_compact_kv_dtypes_arrive_bit_for_bit_with_their_int8_scales(
    sender: SenderProcess, transport: str, request_id: str
) -> None:
    receiver = make_receiver(transport, CONFIG)
    async with _channel(sender) as channel:
        blocks = await receiver.fetch(handoff(request_id, sender, transport), 7, _stub(channel))
    await receiver.close()
    layout = layout_of(request_id)
    assert blocks.dtype == torch_dtype_of(layout)
    assert blocks.shape == layout.tensor_shape(NUM_BLOCKS[request_id] - 7)
    assert torch.equal(blocks, full_blocks(request_id)[:, :, 7:])
    # int8 rows are 32 values and a 4-byte scale: 36 bytes where float32 takes 128.
    assert blocks.numel() * blocks.element_size() == 73 * layout.bytes_per_block
    assert layout.bytes_per_block == {BF16_REQUEST: 16_384, INT8_REQUEST: 9_216}[request_id]


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_unknown_request_fails_with_not_found(sender: SenderProcess, transport: str) -> None:
    receiver = make_receiver(transport, CONFIG)
    async with _channel(sender) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await receiver.fetch(handoff("never-prefilled", sender, transport), 0, _stub(channel))
    await receiver.close()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.asyncio
async def test_fetch_of_blocks_all_cached_here_asks_the_sender_nothing(sender: SenderProcess) -> None:
    receiver = make_receiver("grpc", CONFIG)
    # No channel at all: an RPC would fail.
    everything = NUM_BLOCKS[SMALL_REQUEST]
    blocks = await receiver.fetch(handoff(SMALL_REQUEST, sender, "grpc"), everything, None)  # type: ignore[arg-type]
    assert blocks.shape == LAYOUT.tensor_shape(0)


@pytest.mark.asyncio
async def test_grpc_streams_a_big_tensor_in_ordered_chunks_of_at_most_1_mib(sender: SenderProcess) -> None:
    first_block = 7
    expected = full_blocks(BIG_REQUEST)[:, :, first_block:].contiguous()
    total = expected.numel() * expected.element_size()
    async with _channel(sender) as channel:
        call = _stub(channel).FetchKV(worker_pb2.FetchKVRequest(request_id=BIG_REQUEST, first_block=first_block))
        chunks = [chunk async for chunk in call]
    assert total == 73 * LAYOUT.bytes_per_block == 2_392_064
    assert len(chunks) == math.ceil(total / MAX_CHUNK_BYTES) == 3
    assert [chunk.offset for chunk in chunks] == [0, MAX_CHUNK_BYTES, 2 * MAX_CHUNK_BYTES]
    assert [len(chunk.data) for chunk in chunks] == [MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, total - 2 * MAX_CHUNK_BYTES]
    assert {(chunk.total_bytes, chunk.num_blocks) for chunk in chunks} == {(total, 73)}
    assert b"".join(chunk.data for chunk in chunks) == expected.numpy().tobytes()


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["grpc", "carrier_pigeon"])
async def test_stage_with_a_non_staged_transport_is_invalid_argument(sender: SenderProcess, transport: str) -> None:
    async with _channel(sender) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _stub(channel).StageKV(worker_pb2.StageKVRequest(request_id=SMALL_REQUEST, transport=transport))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shm, torch_dist, cuda_ipc" in (error.value.details() or "")


@pytest.mark.asyncio
async def test_shm_consumed_segments_are_gone_and_unconsumed_ones_go_at_release(sender: SenderProcess) -> None:
    receiver = make_receiver("shm", CONFIG)
    async with _channel(sender) as channel:
        stub = _stub(channel)
        await receiver.fetch(handoff(BIG_REQUEST, sender, "shm"), 0, stub)
        assert shm_segments(SHM_PREFIX) == []
        # A receiver that died after StageKV: the segment waits until the lease ends.
        staged = await stub.StageKV(worker_pb2.StageKVRequest(request_id=SMALL_REQUEST, transport="shm"))
        assert shm_segments(SHM_PREFIX) == [staged.handle.decode()]
        await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=SMALL_REQUEST))
    assert shm_segments(SHM_PREFIX) == []


def test_shm_segments_staged_but_unconsumed_are_unlinked_when_the_sender_shuts_down() -> None:
    prefix = f"{SHM_PREFIX}shutdown_"

    async def stage_and_walk_away(sender: SenderProcess) -> None:
        async with _channel(sender) as channel:
            for request_id in (SMALL_REQUEST, BIG_REQUEST):
                await _stub(channel).StageKV(worker_pb2.StageKVRequest(request_id=request_id, transport="shm"))

    with running_sender(prefix) as sender:
        asyncio.run(stage_and_walk_away(sender))
        assert len(shm_segments(prefix)) == 2
    assert shm_segments(prefix) == []


@pytest.mark.asyncio
async def test_torch_dist_reuses_one_pair_for_sequential_and_concurrent_transfers(sender: SenderProcess) -> None:
    receiver = make_receiver("torch_dist", CONFIG)
    async with _channel(sender) as channel:
        stub = _stub(channel)
        # A refusal before the first transfer leaves the pair usable.
        with pytest.raises(grpc.aio.AioRpcError):
            await receiver.fetch(handoff("never-prefilled", sender, "torch_dist"), 0, stub)
        first = await receiver.fetch(handoff(SMALL_REQUEST, sender, "torch_dist"), 0, stub)
        pairs = dict(receiver._pairs)  # type: ignore[attr-defined]
        concurrent = await asyncio.gather(
            receiver.fetch(handoff(BIG_REQUEST, sender, "torch_dist"), 3, stub),
            receiver.fetch(handoff(SMALL_REQUEST, sender, "torch_dist"), 2, stub),
            receiver.fetch(handoff(BIG_REQUEST, sender, "torch_dist"), 0, stub),
        )
        (pair,) = receiver._pairs.values()  # type: ignore[attr-defined]
        assert list(pairs.values()) == [pair] and pair.group is not None
    await receiver.close()
    assert torch.equal(first, full_blocks(SMALL_REQUEST))
    assert torch.equal(concurrent[0], full_blocks(BIG_REQUEST)[:, :, 3:])
    assert torch.equal(concurrent[1], full_blocks(SMALL_REQUEST)[:, :, 2:])
    assert torch.equal(concurrent[2], full_blocks(BIG_REQUEST))


@pytest.mark.asyncio
async def test_sender_answers_an_empty_range_without_staging_and_rejects_one_past_the_end(
    sender: SenderProcess,
) -> None:
    end = NUM_BLOCKS[SMALL_REQUEST]
    async with _channel(sender) as channel:
        stub = _stub(channel)
        call = stub.FetchKV(worker_pb2.FetchKVRequest(request_id=SMALL_REQUEST, first_block=end))
        chunks = [chunk async for chunk in call]
        staged = await stub.StageKV(
            worker_pb2.StageKVRequest(request_id=SMALL_REQUEST, first_block=end, transport="shm")
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.StageKV(
                worker_pb2.StageKVRequest(request_id=SMALL_REQUEST, first_block=end + 1, transport="shm")
            )
    assert [(chunk.data, chunk.offset, chunk.total_bytes, chunk.num_blocks) for chunk in chunks] == [(b"", 0, 0, 0)]
    assert (staged.handle, staged.total_bytes, staged.num_blocks) == (b"", 0, 0)
    assert shm_segments(SHM_PREFIX) == []
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.asyncio
async def test_torch_dist_pairs_past_the_cap_age_out_and_a_restarted_peer_gets_a_fresh_pair(
    sender: SenderProcess,
) -> None:
    receiver = make_receiver("torch_dist", dataclasses.replace(CONFIG, torch_dist_max_pairs=1))
    expected = full_blocks(SMALL_REQUEST)
    async with _channel(sender) as channel:
        stub = _stub(channel)
        results = []
        # A new epoch means the prefill worker restarted: a new pair, and the old one ages out.
        for epoch in (1, 2, 1):
            moved = dataclasses.replace(handoff(SMALL_REQUEST, sender, "torch_dist"), epoch=epoch)
            results.append(await receiver.fetch(moved, 0, stub))
            assert [key[2] for key in receiver._pairs] == [epoch]  # type: ignore[attr-defined]
    await receiver.close()
    assert all(torch.equal(blocks, expected) for blocks in results)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_a_handoff_that_disagrees_with_the_sender_fails_cleanly_and_the_next_fetch_works(
    sender: SenderProcess, transport: str
) -> None:
    receiver = make_receiver(transport, CONFIG)
    # The sender holds 3 blocks of SMALL_REQUEST; this handoff claims 2.
    wrong = dataclasses.replace(handoff(SMALL_REQUEST, sender, transport), num_tokens=2 * LAYOUT.block_size)
    async with _channel(sender) as channel:
        stub = _stub(channel)
        with pytest.raises(KVTransferError, match=r"expected .*\b2 blocks"):
            await receiver.fetch(wrong, 0, stub)
        blocks = await receiver.fetch(handoff(SMALL_REQUEST, sender, transport), 1, stub)
        # An shm segment staged for the refused transfer stays until the lease ends.
        await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=SMALL_REQUEST))
    await receiver.close()
    assert torch.equal(blocks, full_blocks(SMALL_REQUEST)[:, :, 1:])
    assert shm_segments(SHM_PREFIX) == []
