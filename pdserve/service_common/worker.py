"""A worker process's runtime: its engine thread, its registry entry and its prefix-index publishing."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.cluster_index import (
    BlockEventBatch,
    Heartbeat,
    IndexUnavailable,
    PrefixIndexPublisher,
    WorkerInfo,
    WorkerRegistry,
    cancel_and_wait,
    connect,
)
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.engine.batch_window import BatchWindow
from pdserve.engine.kv.block_manager import BlockEvent, BlockStored
from pdserve.engine.llm_engine import LLMEngine
from pdserve.service_common.convert import lora_from_proto
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.errors import Overloaded, grpc_errors
from pdserve.service_common.metrics import MetricsEndpoint, WorkerMetrics
from pdserve.service_common.server import Server, ServerConfig
from pdserve.shared_cores.openmp import on_a_passing_thread, spin_governor

log = logging.getLogger(__name__)
# The drain of a worker whose engine died: enough for calls that already failed to send their status.
DEAD_ENGINE_GRACE_S = 1.0


@dataclass(frozen=True)
class WorkerConfig:
    """Identity of a worker in the cluster and where its index lives."""

    role: str  # "prefill", "decode" or "colocated" (both, on one engine)
    worker_id: str
    redis_url: str | None = None  # None: no registry, no prefix index (static routing)
    redis_prefix: str = "pdserve"
    heartbeat_ttl_s: float = 10.0
    # Admission limits: past them a request gets RESOURCE_EXHAUSTED at once
    # instead of waiting in an unbounded queue. An idle worker admits any request.
    max_queued_requests: int = 256
    max_queued_tokens: int = 65536
    # pdserve/shared_cores/openmp.py's SPIN_MODES: "adaptive" lets libgomp spin only while other processes leave this
    # one's CPUs idle (``pdserve prefill|decode|colocated``'s default); "libgomp" leaves it to libgomp.
    openmp_spin: str = "libgomp"
    # An idle engine that gets prompts waits up to this long for the rest of a burst before its first
    # step, and a step waits at most this long for requests whose pushed KV has landed
    # (pdserve.engine.batch_window; ``pdserve prefill|decode|colocated --batch-window-ms``). 0: off.
    batch_window_s: float = 0.0


class WorkerRuntime:
    """Owns the engine thread; registers the worker and publishes its prefix blocks when Redis is configured."""

    def __init__(self, engine: LLMEngine, config: WorkerConfig) -> None:
        self.config = config
        self.engine = engine
        self.epoch = time.time_ns()
        self.spin_governor = spin_governor(config.openmp_spin)
        if self.spin_governor is not None:
            log.info("OpenMP spin: adaptive (%d threads on %d CPUs; off while other processes use over %.2f of them)",
                     self.spin_governor.threads, self.spin_governor.cpus,
                     self.spin_governor.headroom + self.spin_governor.busy_cpus)
        if self.spin_governor is not None:
            engine.between_layers = self.spin_governor.update
        self.async_engine = AsyncEngine(
            engine, on_block_events=self._on_block_events,
            before_work=self.spin_governor.update if self.spin_governor is not None else None,
            batch_window=BatchWindow(config.batch_window_s),
            run_load=functools.partial(on_a_passing_thread, name="pdserve-lora"),
        )
        self.metrics = WorkerMetrics(lambda: self.async_engine.latest_stats, spin_governor=self.spin_governor,
                                     handoff_timeout_s=engine.kv_handoff_timeout_s)
        self.address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch = BlockEventBatch()
        self._events_ready = asyncio.Event()
        self._publisher: PrefixIndexPublisher | None = None
        self._heartbeat: Heartbeat | None = None
        self._publish_task: asyncio.Task[None] | None = None
        self._redis = None
        # Requests admitted and not answered yet, and their tokens (event-loop thread only).
        self._queued = (0, 0)

    def admit(self, num_tokens: int) -> AdmissionTicket:
        """Count a request against the queue limits, or raise ``Overloaded``; release the ticket when done."""
        queued_requests, queued_tokens = self._queued
        if queued_requests and (
            queued_requests + 1 > self.config.max_queued_requests
            or queued_tokens + num_tokens > self.config.max_queued_tokens
        ):
            raise Overloaded(
                f"worker {self.config.worker_id} is over its admission limit ({queued_requests} requests, "
                f"{queued_tokens} tokens queued); retry later"
            )
        self._queued = (queued_requests + 1, queued_tokens + num_tokens)
        return AdmissionTicket(self, num_tokens)

    def _release(self, num_tokens: int) -> None:
        queued_requests, queued_tokens = self._queued
        self._queued = (queued_requests - 1, queued_tokens - num_tokens)

    @property
    def info(self) -> WorkerInfo:
        # A colocated worker is indexed as a prefill worker: that is where prefix hits matter.
        role = "prefill" if self.config.role == "colocated" else self.config.role
        return WorkerInfo(
            worker_id=self.config.worker_id,
            role=role,  # type: ignore[arg-type]
            address=self.address,
            epoch=self.epoch,
            model_id=self.engine.model_id,
            block_size=self.engine.block_size,
        )

    async def start(self, address: str) -> None:
        self.address = address
        self._loop = asyncio.get_running_loop()
        self._events_ready = asyncio.Event()
        self.async_engine.start()
        if self.config.redis_url is None:
            return
        self._redis = connect(self.config.redis_url)
        registry = WorkerRegistry(self._redis, self.config.redis_prefix, ttl_s=self.config.heartbeat_ttl_s)
        self._publisher = PrefixIndexPublisher(self._redis, self.config.redis_prefix, self.info)
        await self._publisher.reset()
        await self._resync()
        self._heartbeat = Heartbeat(
            registry, self.info, load_provider=self.load_fields, on_reregistered=self._resync_or_raise
        )
        self._heartbeat.start()
        self._publish_task = asyncio.create_task(self._publish_loop(), name="prefix-index-publisher")

    async def stop(self) -> None:
        if self._publish_task is not None:
            await cancel_and_wait(self._publish_task)
        if self._heartbeat is not None:
            await self._heartbeat.stop(deregister=True)
        if self._publisher is not None:
            await self._publisher.clear()
        if self._redis is not None:
            await self._redis.aclose()
        await self.async_engine.stop()
        if self.spin_governor is not None:
            self.spin_governor.close()

    def load_fields(self) -> dict[str, float | list[str]]:
        stats = self.async_engine.latest_stats
        return {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_queued_tokens": stats.num_queued_tokens,
            "num_free_blocks": stats.num_free_blocks,
            "num_total_blocks": stats.num_total_blocks,
            # The adapters it holds, recorded in the registry beside its load (the gateway routes by them).
            **({"lora_adapters": list(stats.lora_adapters)} if self.engine.lora is not None else {}),
        }

    def load_report(self) -> worker_pb2.LoadReport:
        if not self.async_engine.is_alive:
            # The gateway polls Load: an error here takes this worker out of rotation.
            raise EngineDeadError(f"the engine of worker {self.config.worker_id} is not running")
        stats = self.async_engine.latest_stats
        return worker_pb2.LoadReport(
            worker_id=self.config.worker_id,
            role=self.config.role,
            epoch=self.epoch,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_queued_tokens=stats.num_queued_tokens,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            model_id=self.engine.model_id,
            block_size=self.engine.block_size,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,
            eos_token_ids=sorted(self.engine.eos_token_ids),
            lora_adapters=stats.lora_adapters,
        )

    async def load_lora(self, request: worker_pb2.LoadLoRAAdapterRequest) -> worker_pb2.LoadLoRAAdapterResponse:
        """``LoadLoRAAdapter``: the adapter read into host memory; ``ValueError`` (INVALID_ARGUMENT) naming it."""
        lora = lora_from_proto(request.lora)
        if lora is None:
            raise ValueError("lora.name must be set")
        await self.async_engine.load_lora(lora)
        return worker_pb2.LoadLoRAAdapterResponse()

    async def unload_lora(self, request: worker_pb2.UnloadLoRAAdapterRequest) -> worker_pb2.UnloadLoRAAdapterResponse:
        return worker_pb2.UnloadLoRAAdapterResponse(unloaded=await self.async_engine.unload_lora(request.name))

    # ---- prefix index -----------------------------------------------------------------

    def _on_block_events(self, events: list[BlockEvent]) -> None:
        # Engine thread: hand the events to the loop, in order.
        loop = self._loop
        if loop is None or self._publisher is None:
            return
        loop.call_soon_threadsafe(self._queue_events, events)

    def _queue_events(self, events: list[BlockEvent]) -> None:
        for event in events:
            self._batch.add(isinstance(event, BlockStored), event.block_hashes)
        self._events_ready.set()

    async def _publish_loop(self) -> None:
        assert self._publisher is not None
        while True:
            await self._events_ready.wait()
            self._events_ready.clear()
            changes = self._batch.drain()
            if changes.stored or changes.removed:
                await self._publisher.publish(changes.stored, changes.removed)
            if not self._publisher.in_sync:
                await self._resync()

    async def _resync(self) -> bool:
        """Rewrite this worker's index entries from the block manager's truth; False if Redis failed."""
        if self._publisher is None:
            return True
        hashes = await self.async_engine.call(lambda engine: engine.block_manager.cached_hashes())
        return await self._publisher.resync(hashes)

    async def _resync_or_raise(self) -> None:
        # The heartbeat retries its hook only when the hook raises.
        if not await self._resync():
            raise IndexUnavailable("resyncing the prefix index failed; retrying on the next heartbeat")


class LoRARPCs:
    """The LoRA adapter RPCs both worker services answer (``LoadLoRAAdapter``, ``UnloadLoRAAdapter``), over the
    servicer's ``runtime``."""

    runtime: WorkerRuntime

    @grpc_errors
    async def LoadLoRAAdapter(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadLoRAAdapterResponse:
        return await self.runtime.load_lora(request)

    @grpc_errors
    async def UnloadLoRAAdapter(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.UnloadLoRAAdapterResponse:
        return await self.runtime.unload_lora(request)


class AdmissionTicket:
    """Holds one request's place in a worker's admission count until the context exits."""

    def __init__(self, runtime: WorkerRuntime, num_tokens: int) -> None:
        self._runtime, self._num_tokens = runtime, num_tokens

    def __enter__(self) -> AdmissionTicket:
        return self

    def __exit__(self, *exc: object) -> None:
        self._runtime._release(self._num_tokens)


class WorkerServer:
    """A worker's gRPC server around its runtime: start binds then registers; stop drains then deregisters."""

    def __init__(
        self,
        runtime: WorkerRuntime,
        server_config: ServerConfig,
        service_names: list[str],
        advertise_host: str | None,
        watchdog_s: float = 0.5,
        metrics_port: int | None = None,  # None: no /metrics endpoint; 0: an ephemeral port
    ) -> None:
        self.runtime = runtime
        self.server = Server(server_config, service_names)
        self.advertise_host = advertise_host or server_config.host
        self.watchdog_s = watchdog_s
        self._watchdog: asyncio.Task[None] | None = None
        # Set once the engine thread died: the CLI then exits so a supervisor restarts the process.
        self.engine_dead = asyncio.Event()
        self.metrics_endpoint = (
            MetricsEndpoint(runtime.metrics.registry, server_config.host, metrics_port) if metrics_port is not None else None
        )

    async def start(self) -> int:
        port = await self.server.start()
        await self.runtime.start(f"{self.advertise_host}:{port}")
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.start()
        self._watchdog = asyncio.create_task(self._watch_engine(), name="engine-watchdog")
        log.info("%s worker %s serving on %s", self.runtime.config.role, self.runtime.config.worker_id, self.runtime.address)
        return port

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        # A dead engine finishes nothing: its calls fail at once (EngineDeadError), and whatever
        # still runs is cut short, so that the process exits for its supervisor promptly.
        grace_s = min(self.server.config.grace_s, DEAD_ENGINE_GRACE_S) if self.engine_dead.is_set() else None
        await self.server.stop(grace_s)
        await self.close_servicer()
        await self.runtime.stop()
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.stop()

    async def _watch_engine(self) -> None:
        """Health follows the engine thread: a dead engine makes the worker NOT_SERVING."""
        while self.runtime.async_engine.is_alive:
            await asyncio.sleep(self.watchdog_s)
        log.error("engine of worker %s stopped: %r; health is NOT_SERVING", self.runtime.config.worker_id,
                  self.runtime.async_engine.error)
        await self.server.set_serving(False)
        self.engine_dead.set()

    async def close_servicer(self) -> None:
        """Free what the role's servicer holds (leases, channels), after the server stopped."""
