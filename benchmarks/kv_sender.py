"""A stand-in prefill worker for the transfer benchmark: serves one held request of a given layout.

``python -m benchmarks.kv_sender NUM_LAYERS KV_HEADS HEAD_DIM BLOCK_SIZE NUM_BLOCKS [DEVICE]`` prints its
port, serves FetchKV / StageKV / ReleaseKV on 127.0.0.1 until SIGTERM. The blocks live on DEVICE (default
cpu; cuda:0 for the cuda_ipc transport), as a prefill worker's KV pool would.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc
import torch

from pdserve.kv_transfer import INTERNAL_GRPC_OPTIONS, KVSenderServicer, TransferConfig
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc

REQUEST_ID = "bench"


class _HeldBlocks:
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    @property
    def num_layers(self) -> int:
        return self.blocks.shape[0]

    def export(
        self, request_id: str, first_block: int, layers: slice = slice(None), heads: range | None = None
    ) -> torch.Tensor:
        if request_id != REQUEST_ID:
            raise KeyError(request_id)
        heads = heads or range(self.blocks.shape[4])
        # A copy, as the engine's export makes one: part of the real cost.
        return self.blocks[layers, :, first_block:, :, heads.start : heads.stop].clone()


class _Servicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, kv: KVSenderServicer) -> None:
        self.kv = kv
        self.FetchKV = kv.FetchKV
        self.StageKV = kv.StageKV

    async def ReleaseKV(self, request, context):  # noqa: N802, ANN001, ANN201
        self.kv.release(request.request_id)
        return worker_pb2.ReleaseKVResponse()


async def serve(layers: int, heads: int, head_dim: int, block_size: int, num_blocks: int, device: str) -> None:
    blocks = torch.randn(layers, 2, num_blocks, block_size, heads, head_dim, generator=torch.Generator().manual_seed(0))
    kv = KVSenderServicer(_HeldBlocks(blocks.to(device)), TransferConfig(shm_prefix="pdserve_bench_", device=device))
    server = grpc.aio.server(options=INTERNAL_GRPC_OPTIONS)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_Servicer(kv), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(port, flush=True)
    await stop.wait()
    await server.stop(grace=1.0)
    kv.close()


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:6]]
    asyncio.run(serve(*sizes, sys.argv[6] if len(sys.argv) > 6 else "cpu"))
