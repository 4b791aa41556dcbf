"""Prefill workers, decode workers and a gateway as grpc.aio servers in this process, on ephemeral loopback ports.

How a test builds one (the fixture stops it after the test, even when the test fails)::

    async def test_something(llama_checkpoint, start_inprocess_cluster) -> None:
        cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=64, http=True))
        responses = await cluster.generate(request)

or, where a fixture does not fit (a module-scoped cluster, a cluster stopped mid-test)::

    async with InProcessCluster(llama_checkpoint, ClusterOptions(...)) as cluster:
        ...
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pdserve.cluster_index import connect
from pdserve.decode_service.colocated import ColocatedServer
from pdserve.decode_service.server import DecodeServer
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pdserve.engine.types.lora import LoRAConfig
from pdserve.engine.types.speculative import SpeculativeConfig
from pdserve.gateway.server import GatewayServer
from pdserve.prefill_service.server import PrefillServer
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.security import TlsConfig, open_channel
from pdserve.service_common.server import DEFAULT_MAX_MESSAGE_BYTES, ServerConfig
from pdserve.service_common.worker import WorkerConfig
from tests.support.waiting import DEFAULT_TIMEOUT_S, wait_until

REDIS_URL = "redis://127.0.0.1:6379/0"
NUM_KV_BLOCKS = 128  # 2048 tokens: more than the tiny model's 1024-token context
# The harness may send more than the servers accept, so that the server's limit is what gets tested.
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
]

Worker = PrefillServer | DecodeServer | ColocatedServer
WorkerStub = worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub


def tiny_engine(
    checkpoint: Path,
    num_kv_blocks: int = NUM_KV_BLOCKS,
    speculative_config: SpeculativeConfig | None = None,
    handoff_draft_kv: bool = False,
    tensor_parallel_size: int = 1,
    kv_handoff_timeout_s: float = 30.0,
    lora_config: LoRAConfig | None = None,
) -> LLMEngine:
    """A float32 engine over ``checkpoint`` with a pool of ``num_kv_blocks`` KV blocks."""
    model = ModelConfig(model=str(checkpoint), dtype="float32")
    return LLMEngine(
        EngineConfig(model=model, cache=CacheConfig(num_kv_blocks=num_kv_blocks), speculative_config=speculative_config,
                     handoff_draft_kv=handoff_draft_kv,
                     parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
                     kv_handoff_timeout_s=kv_handoff_timeout_s, lora_config=lora_config)
    )


@dataclass(frozen=True)
class ClusterOptions:
    """What an ``InProcessCluster`` runs; the defaults: one prefill worker, one decode worker, a gateway, no Redis."""

    num_kv_blocks: int = NUM_KV_BLOCKS  # per worker
    prefill_workers: int = 1
    decode_workers: int = 1
    colocated_workers: int = 0  # workers that prefill and decode on one engine; the gateway uses them for both
    gateway: bool = True  # False: workers only, for a test of a worker on its own
    worker_server: ServerConfig = field(default_factory=ServerConfig)  # the workers' ports: TLS, auth
    gateway_server: ServerConfig = field(default_factory=ServerConfig)  # the public port: TLS, auth
    # Every channel to a worker (the gateway's, the decode workers', this harness's) and this harness's
    # channel to the gateway; None: plaintext.
    client_tls: TlsConfig | None = None
    redis: bool = False  # True: the real Redis under a fresh key prefix, whose keys are deleted on stop
    # Every worker's handoff deadline: prefill leases, unclaimed pushes and early starts.
    kv_handoff_timeout_s: float = 30.0
    kv_failure_policy: str = "recompute"  # decode workers
    kv_transport: str = "grpc"  # what the gateway asks the workers to use
    max_queued_requests: int | None = None  # workers' admission limits; None: WorkerConfig's defaults
    max_queued_tokens: int | None = None
    max_inflight_requests: int | None = None  # the gateway's admission limit; None: its default
    gateway_args: Mapping[str, Any] = field(default_factory=dict)  # any other GatewayServer keyword argument
    metrics: bool = False  # every server exports Prometheus /metrics on an ephemeral port
    http: bool = False  # the gateway serves the OpenAI-compatible HTTP API on an ephemeral port
    tokenizer: object = None  # the gateway's; None: token ids only
    ready_timeout_s: float = DEFAULT_TIMEOUT_S  # until the gateway has heard from a worker of each role
    speculative_config: SpeculativeConfig | None = None  # decode and colocated workers' engines
    # Prefill workers' engines, which then build the draft's prompt KV for the handoff (handoff_draft_kv).
    prefill_speculative_config: SpeculativeConfig | None = None
    # The gateway's --disaggregation. "always" here (the gateway's default is auto): the tests of handoffs,
    # leases and failures are about the remote path; tests of conditional disaggregation set it.
    disaggregation: str = "always"
    prefill_tp: int = 1  # tensor_parallel_size of the prefill workers' engines
    decode_tp: int = 1  # of the decode and colocated workers' engines
    lora_config: LoRAConfig | None = None  # every worker's engine serves LoRA adapters with it; None: no LoRA


class InProcessCluster:
    """Workers and a gateway on ephemeral loopback ports, with channels and stubs to each.

    ``prefill`` and ``decode`` are the first worker of each role, ``worker_stubs`` the prefill
    workers' stubs, then the decode workers', then the colocated workers' (prefill stubs; Load
    answers on either service). Use as ``async with``, or call ``start`` and then ``stop`` in a
    ``finally`` (``stop`` also cleans up after a ``start`` that raised).
    """

    def __init__(self, checkpoint: Path, options: ClusterOptions | None = None) -> None:
        self.checkpoint = checkpoint
        self.options = options or ClusterOptions()
        self.redis_prefix = f"pdserve-test-{uuid.uuid4().hex}" if self.options.redis else None
        self.prefills: list[PrefillServer] = []
        self.decodes: list[DecodeServer] = []
        self.colocated: list[ColocatedServer] = []
        self.gateway: GatewayServer | None = None
        self.prefill_addresses: list[str] = []
        self.decode_addresses: list[str] = []
        self.colocated_addresses: list[str] = []
        self.gateway_address: str | None = None
        self.channel: grpc.aio.Channel | None = None  # to the gateway
        self.stub: generation_pb2_grpc.GenerationStub | None = None
        self.worker_stubs: list[WorkerStub] = []
        self._servers: list[Worker | GatewayServer] = []
        self._channels: list[grpc.aio.Channel] = []

    @property
    def prefill(self) -> PrefillServer:
        return self.prefills[0]

    @property
    def decode(self) -> DecodeServer:
        return self.decodes[0]

    async def __aenter__(self) -> InProcessCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start every server and open the harness's channels; call ``stop`` even when this raises."""
        options = self.options
        for index in range(options.prefill_workers):
            server = PrefillServer(self._engine(), options.worker_server, self._worker_config("prefill", f"p{index}"),
                                   metrics_port=self._metrics_port())
            self.prefill_addresses.append(await self._start(server))
            self.prefills.append(server)
        for index in range(options.decode_workers):
            server = DecodeServer(self._engine(decodes=True), options.worker_server, self._worker_config("decode", f"d{index}"),
                                  kv_failure_policy=options.kv_failure_policy, client_tls=options.client_tls,
                                  metrics_port=self._metrics_port())
            self.decode_addresses.append(await self._start(server))
            self.decodes.append(server)
        for index in range(options.colocated_workers):
            server = ColocatedServer(
                self._engine(decodes=True), options.worker_server, self._worker_config("colocated", f"c{index}"),
                kv_failure_policy=options.kv_failure_policy, client_tls=options.client_tls,
                metrics_port=self._metrics_port(),
            )
            self.colocated_addresses.append(await self._start(server))
            self.colocated.append(server)
        self.worker_stubs = [
            *(worker_pb2_grpc.PrefillWorkerStub(self._open(address)) for address in self.prefill_addresses),
            *(worker_pb2_grpc.DecodeWorkerStub(self._open(address)) for address in self.decode_addresses),
            *(worker_pb2_grpc.PrefillWorkerStub(self._open(address)) for address in self.colocated_addresses),
        ]
        if options.gateway:
            await self._start_gateway()

    async def stop(self) -> None:
        """Close the harness's channels, stop the servers newest first, delete this cluster's Redis keys."""
        channels, self._channels = self._channels, []
        for channel in channels:
            await channel.close()
        servers, self._servers = self._servers, []
        for server in reversed(servers):
            await server.stop()
        if self.redis_prefix is not None:
            await _delete_keys(self.redis_prefix)

    async def generate(
        self, request: generation_pb2.GenerateRequest, timeout_s: float = 20.0
    ) -> list[generation_pb2.GenerateResponse]:
        assert self.stub is not None, "this cluster has no gateway"
        return [response async for response in self.stub.Generate(request, timeout=timeout_s)]

    async def loads(self) -> list[worker_pb2.LoadReport]:
        """Every worker's load report, prefill workers first."""
        return [await stub.Load(worker_pb2.LoadRequest(), timeout=5) for stub in self.worker_stubs]

    async def wait_idle(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[worker_pb2.LoadReport]:
        """Every worker's load report once nothing runs, waits or holds blocks.

        Leases and aborts are released in the background, after the RPC that ended
        the request has returned, hence the wait.
        """
        return await wait_until(self.loads, "every worker to be idle with every block free", timeout_s, until=_all_idle)

    def _engine(self, decodes: bool = False) -> LLMEngine:
        timeout_s = self.options.kv_handoff_timeout_s
        if decodes:
            return tiny_engine(self.checkpoint, self.options.num_kv_blocks, self.options.speculative_config,
                               tensor_parallel_size=self.options.decode_tp, kv_handoff_timeout_s=timeout_s,
                               lora_config=self.options.lora_config)
        spec = self.options.prefill_speculative_config
        return tiny_engine(self.checkpoint, self.options.num_kv_blocks, spec, handoff_draft_kv=spec is not None,
                           tensor_parallel_size=self.options.prefill_tp, kv_handoff_timeout_s=timeout_s,
                           lora_config=self.options.lora_config)

    def _worker_config(self, role: str, worker_id: str) -> WorkerConfig:
        limits = {
            name: value
            for name, value in (("max_queued_requests", self.options.max_queued_requests),
                                ("max_queued_tokens", self.options.max_queued_tokens))
            if value is not None
        }
        if self.redis_prefix is None:
            return WorkerConfig(role, worker_id, **limits)
        return WorkerConfig(role, worker_id, REDIS_URL, self.redis_prefix, **limits)

    def _metrics_port(self) -> int | None:
        return 0 if self.options.metrics else None

    async def _start(self, server: Worker | GatewayServer) -> str:
        port = await server.start()
        self._servers.append(server)
        return f"127.0.0.1:{port}"

    async def _start_gateway(self) -> None:
        options = self.options
        extra = dict(options.gateway_args)
        if options.max_inflight_requests is not None:
            extra["max_inflight_requests"] = options.max_inflight_requests
        self.gateway = GatewayServer(
            options.gateway_server, options.tokenizer, self.prefill_addresses + self.colocated_addresses,
            self.decode_addresses + self.colocated_addresses,
            redis_url=REDIS_URL if self.redis_prefix is not None else None, redis_prefix=self.redis_prefix or "pdserve",
            transport=options.kv_transport, client_tls=options.client_tls,
            http_port=0 if options.http else None, metrics_port=self._metrics_port(),
            disaggregation=options.disaggregation, **extra,
        )
        self.gateway_address = await self._start(self.gateway)
        # Once the gateway has polled a worker of each role it knows the model's limits.
        serves_both = options.colocated_workers > 0
        if (options.prefill_workers or serves_both) and (options.decode_workers or serves_both):
            if not await self.gateway.pool.wait_ready(options.ready_timeout_s):
                raise RuntimeError(
                    f"the gateway saw no healthy prefill and decode worker in {options.ready_timeout_s:g} s"
                )
        self.channel = self._open(self.gateway_address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def _open(self, address: str) -> grpc.aio.Channel:
        channel = open_channel(address, self.options.client_tls, CLIENT_OPTIONS)
        self._channels.append(channel)
        return channel


def _all_idle(reports: Sequence[worker_pb2.LoadReport]) -> bool:
    return all(r.num_running == 0 and r.num_waiting == 0 and r.num_free_blocks == r.num_total_blocks for r in reports)


async def _delete_keys(prefix: str) -> None:
    """Only this cluster's keys: the Redis server is shared with other tests."""
    redis = connect(REDIS_URL)
    try:
        keys = [key async for key in redis.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await redis.delete(*keys)
    finally:
        await redis.aclose()
