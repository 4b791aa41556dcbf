"""Reliability tests: bad and random requests against an in-process cluster.

The cluster both modules share lives here (a conftest would be the usual place;
this package keeps its helpers next to its tests).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from gateway.server import GatewayServer
from prefill_service.server import PrefillServer
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from service_common.server import DEFAULT_MAX_MESSAGE_BYTES, ServerConfig
from service_common.worker import WorkerConfig

NUM_KV_BLOCKS = 128  # 2048 tokens: more than the tiny model's 1024-token context
# The client may send more than the servers accept, so that the server's limit is what gets tested.
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
]


def _engine(checkpoint: Path) -> LLMEngine:
    model = ModelConfig(model=str(checkpoint), dtype="float32")
    return LLMEngine(EngineConfig(model=model, cache=CacheConfig(num_kv_blocks=NUM_KV_BLOCKS)))


class InProcessCluster:
    """A prefill worker, a decode worker and a gateway (no tokenizer, no Redis) on ephemeral loopback ports."""

    def __init__(self, checkpoint: Path) -> None:
        self.prefill = PrefillServer(_engine(checkpoint), ServerConfig(), WorkerConfig("prefill", "p0"))
        self.decode = DecodeServer(_engine(checkpoint), ServerConfig(), WorkerConfig("decode", "d0"))
        self._servers: list[PrefillServer | DecodeServer | GatewayServer] = []
        self._channels: list[grpc.aio.Channel] = []
        self.gateway: GatewayServer | None = None
        self.stub: generation_pb2_grpc.GenerationStub | None = None
        self.channel: grpc.aio.Channel | None = None
        self.worker_stubs: list[worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub] = []

    async def start(self) -> None:
        """Start every server; call ``stop`` even when this raises."""
        p_port = await self.prefill.start()
        self._servers.append(self.prefill)
        d_port = await self.decode.start()
        self._servers.append(self.decode)
        self.gateway = GatewayServer(ServerConfig(), None, [f"127.0.0.1:{p_port}"], [f"127.0.0.1:{d_port}"])
        g_port = await self.gateway.start()
        self._servers.append(self.gateway)
        # The gateway polled both workers before serving, so it knows the model's limits.
        assert await self.gateway.pool.wait_ready(5.0)
        self.channel = self._open(f"127.0.0.1:{g_port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.worker_stubs = [
            worker_pb2_grpc.PrefillWorkerStub(self._open(f"127.0.0.1:{p_port}")),
            worker_pb2_grpc.DecodeWorkerStub(self._open(f"127.0.0.1:{d_port}")),
        ]

    async def stop(self) -> None:
        for channel in self._channels:
            await channel.close()
        for server in reversed(self._servers):
            await server.stop()

    def _open(self, address: str) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
        self._channels.append(channel)
        return channel

    async def generate(
        self, request: generation_pb2.GenerateRequest, timeout_s: float = 20.0
    ) -> list[generation_pb2.GenerateResponse]:
        assert self.stub is not None
        return [response async for response in self.stub.Generate(request, timeout=timeout_s)]

    async def loads(self) -> list[worker_pb2.LoadReport]:
        return [await stub.Load(worker_pb2.LoadRequest(), timeout=5) for stub in self.worker_stubs]

    async def wait_idle(self, timeout_s: float = 10.0) -> list[worker_pb2.LoadReport]:
        """Both workers' load reports once nothing runs, waits or holds blocks (or the last ones at timeout).

        Leases and aborts are released in the background, hence the wait.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            reports = await self.loads()
            idle = all(
                r.num_running == 0 and r.num_waiting == 0 and r.num_free_blocks == r.num_total_blocks for r in reports
            )
            if idle or loop.time() > deadline:
                return reports
            await asyncio.sleep(0.05)
