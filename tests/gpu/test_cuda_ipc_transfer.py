"""GPU transports across real processes: cuda_ipc (one GPU) and torch_dist over NCCL (two GPUs).

Marked ``gpu``; skipped where CUDA is absent (every CI machine), run on a lent GPU machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import pytest
import torch

from pdserve.kv_transfer import INTERNAL_GRPC_OPTIONS, TransferConfig, make_receiver
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from tests.kv_transfer.seeded_source import BIG_REQUEST, NUM_BLOCKS, SMALL_REQUEST, full_blocks
from tests.kv_transfer.sender_harness import SenderProcess, handoff, running_sender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHM_PREFIX = f"pdserve_kv_gpu_test_{os.getpid()}_"


@pytest.fixture(scope="module")
def sender() -> Iterator[SenderProcess]:
    with running_sender(SHM_PREFIX) as process:
        yield process


@pytest.mark.asyncio
@pytest.mark.parametrize(("request_id", "first_block"), [(SMALL_REQUEST, 0), (BIG_REQUEST, 7)])
async def test_cuda_ipc_fetch_returns_exactly_the_held_blocks_on_the_gpu(
    sender: SenderProcess, request_id: str, first_block: int
) -> None:
    receiver = make_receiver("cuda_ipc", TransferConfig(device="cuda:0"))
    async with grpc.aio.insecure_channel(sender.address, options=INTERNAL_GRPC_OPTIONS) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        blocks = await receiver.fetch(handoff(request_id, sender, "cuda_ipc"), first_block, stub)
        # The receiver holds its own copy: ending the lease frees the sender's memory without touching it.
        await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=request_id))
    assert blocks.device == torch.device("cuda", 0)
    assert torch.equal(blocks.cpu(), full_blocks(request_id)[:, :, first_block:])


@pytest.mark.asyncio
async def test_cuda_ipc_unknown_request_fails_with_not_found(sender: SenderProcess) -> None:
    receiver = make_receiver("cuda_ipc", TransferConfig(device="cuda:0"))
    async with grpc.aio.insecure_channel(sender.address, options=INTERNAL_GRPC_OPTIONS) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await receiver.fetch(
                handoff("never-prefilled", sender, "cuda_ipc"), 0, worker_pb2_grpc.PrefillWorkerStub(channel)
            )
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.asyncio
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL point-to-point needs two GPUs")
async def test_torch_dist_over_nccl_moves_blocks_between_gpus() -> None:
    with running_sender(f"{SHM_PREFIX}nccl_", "nccl", "cuda:0") as sender:
        receiver = make_receiver("torch_dist", TransferConfig(torch_dist_backend="nccl", device="cuda:1"))
        async with grpc.aio.insecure_channel(sender.address, options=INTERNAL_GRPC_OPTIONS) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            first = await receiver.fetch(handoff(BIG_REQUEST, sender, "torch_dist"), 7, stub)
            second = await receiver.fetch(handoff(SMALL_REQUEST, sender, "torch_dist"), 0, stub)
        await receiver.close()
    assert first.device == torch.device("cuda", 1)
    assert torch.equal(first.cpu(), full_blocks(BIG_REQUEST)[:, :, 7:])
    assert torch.equal(second.cpu(), full_blocks(SMALL_REQUEST))
    assert NUM_BLOCKS[SMALL_REQUEST] == second.shape[2]
