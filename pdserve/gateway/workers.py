"""The gateway's view of the workers: addresses, identities and load, kept fresh in the background."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from pdserve.cluster_index import IndexUnavailable, WorkerRegistry, cancel_and_wait
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.security import TlsConfig, open_channel
from pdserve.service_common.server import WORKER_KEEPALIVE_MS, channel_options

log = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    """One worker as the router sees it: its stub, its last load report, and what this gateway sent it."""

    address: str
    role: str  # "prefill" or "decode"
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    report: worker_pb2.LoadReport | None = None
    healthy: bool = False
    # Work this gateway dispatched and has not seen finish: fresher than the last report.
    inflight_requests: int = 0
    inflight_tokens: int = 0
    static: bool = False  # from a flag, kept even when Redis does not list it
    _failures: int = field(default=0, repr=False)

    @property
    def worker_id(self) -> str:
        return self.report.worker_id if self.report is not None else self.address

    @property
    def epoch(self) -> int:
        return self.report.epoch if self.report is not None else 0


class Inflight:
    """A request counted against a worker while this gateway waits on it: one of its ``inflight_requests``,
    and ``tokens`` of work queued there (prompt tokens it has yet to compute) in its ``inflight_tokens``
    until ``computed``; the router weighs both before the worker's next load report."""

    def __init__(self, worker: WorkerHandle, tokens: int = 0) -> None:
        self.worker, self.tokens = worker, tokens

    def __enter__(self) -> Inflight:
        self.worker.inflight_requests += 1
        self.worker.inflight_tokens += self.tokens
        return self

    def computed(self) -> None:
        """The counted tokens are done (the worker sent its first token): the request alone stays counted."""
        self.worker.inflight_tokens -= self.tokens
        self.tokens = 0

    def __exit__(self, *exc: object) -> None:
        self.worker.inflight_requests -= 1
        self.worker.inflight_tokens -= self.tokens


class WorkerPool:
    """Workers from flags and from the Redis registry, polled for load every ``poll_s`` seconds."""

    def __init__(
        self,
        prefill_addresses: list[str],
        decode_addresses: list[str],
        registry: WorkerRegistry | None = None,
        poll_s: float = 0.5,
        max_message_bytes: int = 4 * 1024 * 1024,
        tls: TlsConfig | None = None,
    ) -> None:
        self.registry = registry
        self.poll_s = poll_s
        self.tls = tls  # of the channels to workers; None: plaintext
        # Reconnect quickly to a restarted worker: grpc's default backoff grows to minutes.
        self._options = [
            *channel_options(max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            # A worker that stops answering (partitioned, frozen) fails its calls within about 2 keepalives,
            # so its streams move to another worker (pdserve/gateway/migration.py) instead of hanging.
            ("grpc.keepalive_time_ms", WORKER_KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", WORKER_KEEPALIVE_MS),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        self.workers: dict[str, WorkerHandle] = {}
        for address in prefill_addresses:
            self._add(address, "prefill", static=True)
        for address in decode_addresses:
            self._add(address, "decode", static=True)
        self._task: asyncio.Task[None] | None = None
        self.refreshed = asyncio.Event()

    def healthy(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll_loop(), name="worker-pool-poll")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)  # its refresh calls Redis
        for worker in self.workers.values():
            await worker.channel.close()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Until at least one prefill and one decode worker answer, or ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if self.healthy("prefill") and self.healthy("decode"):
                return True
            await asyncio.sleep(0.1)
        return False

    async def refresh(self) -> None:
        if self.registry is not None:
            await self._sync_registry()
        await asyncio.gather(*(self._poll(worker) for worker in list(self.workers.values())))
        self.refreshed.set()

    def _add(self, address: str, role: str, static: bool) -> WorkerHandle:
        channel = open_channel(address, self.tls, self._options)
        stub_class = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        handle = WorkerHandle(address, role, channel, stub_class(channel), static=static)
        self.workers[f"{role}@{address}"] = handle
        return handle

    async def _sync_registry(self) -> None:
        assert self.registry is not None
        try:
            live = await self.registry.live_workers()
        except IndexUnavailable:
            return  # keep the workers we know; Redis is only an index
        listed = set()
        for info in live:
            key = f"{info.role}@{info.address}"
            listed.add(key)
            if key not in self.workers:
                self._add(info.address, info.role, static=False)
                log.info("discovered %s worker %s at %s", info.role, info.worker_id, info.address)
        for key, worker in list(self.workers.items()):
            if not worker.static and key not in listed:
                # Its registry entry expired: the worker is gone.
                del self.workers[key]
                await worker.channel.close()

    async def _poll(self, worker: WorkerHandle) -> None:
        try:
            report = await worker.stub.Load(worker_pb2.LoadRequest(), timeout=1.0)
        except grpc.aio.AioRpcError as error:
            worker._failures += 1
            if worker.healthy:
                log.warning("%s worker at %s is unreachable: %s", worker.role, worker.address, error.code())
            worker.healthy = False
            return
        if worker.report is not None and report.epoch != worker.report.epoch:
            log.info("%s worker at %s restarted (epoch %d)", worker.role, worker.address, report.epoch)
            worker.inflight_requests = worker.inflight_tokens = 0
        worker.report = report
        # A colocated worker serves both roles from one engine.
        worker.healthy = report.role in (worker.role, "colocated")
        worker._failures = 0

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - polling must outlive any one failure
                log.exception("refreshing the worker pool failed")
