"""A stand-in prefill worker for the transfer tests: FetchKV / StageKV / ReleaseKV over ``SeededSource``.

Run as ``python sender_process.py SHM_PREFIX [TORCH_DIST_BACKEND [DEVICE]]`` with the repository root on
PYTHONPATH; prints the bound port on stdout, serves on 127.0.0.1 until
SIGTERM, then stops the server and frees what is staged.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc

from pdserve.kv_transfer import INTERNAL_GRPC_OPTIONS, KVSenderServicer, TransferConfig
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from tests.kv_transfer.seeded_source import SeededSource


class _PrefillStandIn(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, kv: KVSenderServicer) -> None:
        self.kv = kv
        # Bound, not wrapped: grpc.aio needs FetchKV to be an async generator function itself.
        self.FetchKV = kv.FetchKV
        self.StageKV = kv.StageKV

    async def ReleaseKV(  # noqa: N802
        self, request: worker_pb2.ReleaseKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseKVResponse:
        self.kv.release(request.request_id)
        return worker_pb2.ReleaseKVResponse()


async def serve(shm_prefix: str, torch_dist_backend: str, device: str) -> None:
    config = TransferConfig(
        shm_prefix=shm_prefix, torch_dist_backend=torch_dist_backend, torch_dist_timeout_s=20.0, device=device
    )
    kv = KVSenderServicer(SeededSource(), config)
    server = grpc.aio.server(options=INTERNAL_GRPC_OPTIONS)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_PrefillStandIn(kv), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(port, flush=True)
    await stop.wait()
    await server.stop(grace=1.0)
    kv.close()


if __name__ == "__main__":
    arguments = [*sys.argv[1:], "gloo", "cpu"]
    asyncio.run(serve(arguments[0], arguments[1], arguments[2]))
