"""Prometheus metrics of the gateway and the workers, each process with its own registry, served at /metrics.

Every process builds its own ``CollectorRegistry`` (never prometheus_client's
global one): tests run a gateway and several workers in one process, and each
must report only its own numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.service_common.errors import status_for

if TYPE_CHECKING:
    from pdserve.engine.types.outputs import EngineStats
    from pdserve.protos.pdserve.v1 import generation_pb2
    from pdserve.shared_cores.openmp import SpinGovernor

log = logging.getLogger(__name__)

# How a gateway request ended, one label value each.
OUTCOMES = ("ok", "cancelled", "deadline", "invalid", "unavailable", "overloaded", "error")
_OUTCOME_BY_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.NOT_FOUND: "invalid",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.CANCELLED: "cancelled",
}

# Bucket bounds in seconds: a first token from a few ms (cached, tiny prompt) to a
# minute (a long prompt queued behind others); a decode step from 1 ms to seconds.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_REQUEST_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


def outcome_of(error: BaseException | None, deadline_passed: bool) -> str:
    """The ``outcome`` label of a request that ended with ``error`` (None: it finished)."""
    if error is None:
        return "ok"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        # grpc cancels the handler both when the client goes away and when its deadline passes.
        return "deadline" if deadline_passed else "cancelled"
    code = error.code() if isinstance(error, grpc.aio.AioRpcError) else status_for(error)
    return _OUTCOME_BY_STATUS.get(code, "error")


class GatewayMetrics:
    """The gateway's request outcomes, latencies, routing decisions and prefix-cache hits."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "Generate requests by how they ended", ["outcome"],
                                registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome exported from the start, at 0
        self.time_to_first_token = Histogram(
            "pdserve_time_to_first_token_seconds", "From the request's arrival to its first streamed token",
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS, registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "pdserve_time_per_output_token_seconds", "Mean time between output tokens after the first, per request",
            buckets=TIME_PER_OUTPUT_TOKEN_BUCKETS, registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "pdserve_e2e_request_latency_seconds", "From arrival to the last token, of requests that finished",
            buckets=E2E_REQUEST_LATENCY_BUCKETS, registry=self.registry,
        )
        self.requests_running = Gauge("pdserve_requests_running", "Generate requests in flight through this gateway",
                                      registry=self.registry)
        self.routing_decisions = Counter("pdserve_routing_decisions", "Workers chosen, by role and worker id",
                                         ["role", "worker"], registry=self.registry)
        self.prefix_cache_hit_tokens = Counter(
            "pdserve_prefix_cache_hit_tokens", "Prompt tokens of finished requests found in a prefill worker's cache",
            registry=self.registry,
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.prefill_routes = Counter(
            "pdserve_gateway_prefill_route",
            "Where requests were prefilled (remote: a prefill worker; local: their decode worker), and why",
            ["route", "reason"], registry=self.registry,
        )
        # A worker that failed before sending anything is replaced by another; without this count
        # a cluster that keeps losing workers looks healthy from the request outcomes alone.
        self.worker_retries = Counter(
            "pdserve_gateway_worker_retries",
            "Requests moved to another worker after theirs failed before sending anything, by that worker's role",
            ["role"], registry=self.registry,
        )
        for role in ("prefill", "decode"):
            self.worker_retries.labels(role)  # exported from the start, at 0
        # Streams moved to another decode worker after theirs failed mid-stream (pdserve/gateway/migration.py).
        self.migrations = Counter(
            "pdserve_gateway_migrations", "Streams moved to another worker after theirs failed, by cause and outcome",
            ["cause", "outcome"], registry=self.registry,
        )
        self.migration_pause = Histogram(
            "pdserve_gateway_migration_pause_seconds",
            "From a stream's worker failing to the first token from the worker it moved to",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=self.registry,
        )

    def routed(self, role: str, worker_id: str) -> None:
        self.routing_decisions.labels(role, worker_id).inc()

    def prefill_routed(self, route: str, reason: str) -> None:
        self.prefill_routes.labels(route, reason).inc()

    def retried(self, role: str) -> None:
        self.worker_retries.labels(role).inc()

    def migrated(self, cause: str, outcome: str, pause_s: float | None = None) -> None:
        self.migrations.labels(cause, outcome).inc()
        if pause_s is not None:
            self.migration_pause.observe(pause_s)

    @contextlib.contextmanager
    def track(self, deadline_passed: Callable[[], bool]) -> Iterator[RequestTracker]:
        """Count one request while it runs and record how it ended (an exception passes through)."""
        tracker = RequestTracker(self)
        self.requests_running.inc()
        try:
            yield tracker
        except BaseException as error:
            tracker.finish(outcome_of(error, deadline_passed()))
            raise
        else:
            tracker.finish("ok")
        finally:
            self.requests_running.dec()


class RequestTracker:
    """Times one gateway request: TTFT at its first response; TPOT, end-to-end latency and usage when it finishes."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.arrived = time.perf_counter()
        self.first_token_at: float | None = None
        self.usage: generation_pb2.Usage | None = None

    def responded(self, response: generation_pb2.GenerateResponse) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.metrics.time_to_first_token.observe(self.first_token_at - self.arrived)
        if response.HasField("usage"):
            self.usage = response.usage

    def finish(self, outcome: str) -> None:
        self.metrics.requests.labels(outcome).inc()
        if outcome != "ok":
            return
        finished = time.perf_counter()
        self.metrics.e2e_request_latency.observe(finished - self.arrived)
        if self.usage is None:
            return
        self.metrics.prompt_tokens.inc(self.usage.prompt_tokens)
        self.metrics.prefix_cache_hit_tokens.inc(self.usage.cached_prompt_tokens)
        if self.first_token_at is not None and self.usage.completion_tokens > 1:
            self.metrics.time_per_output_token.observe(
                (finished - self.first_token_at) / (self.usage.completion_tokens - 1)
            )


class WorkerMetrics:
    """A worker's engine load (read at scrape time), prefix-cache hits and KV transfers."""

    def __init__(
        self, engine_stats: Callable[[], EngineStats], spin_governor: SpinGovernor | None = None,
        handoff_timeout_s: float = 0.0,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine_stats))
        self._expired_handoffs = _ExpiredHandoffs(engine_stats, handoff_timeout_s)
        self.registry.register(self._expired_handoffs)
        if spin_governor is not None:
            self.registry.register(_SpinGovernorCollector(spin_governor))
        self.prefix_cache_hit_tokens = Counter(
            "pdserve_prefix_cache_hit_tokens", "Prompt tokens prefilled here that were already in the cache",
            registry=self.registry,
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens prefilled here", registry=self.registry)
        self.kv_transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV cache bytes received from prefill workers",
                                         ["transport"], registry=self.registry)
        self.kv_transfer_seconds = Counter("pdserve_kv_transfer_seconds", "Time spent receiving KV cache",
                                           ["transport"], registry=self.registry)

    def watch_early_starts(self, early: object) -> None:
        """Export a decode worker's early starts (``pdserve.decode_service.early_start.EarlyStarts``), read when
        scraped; those that expired count with the other expired handoffs."""
        self._expired_handoffs.early_starts = early
        self.registry.register(_OutcomeCounts(
            "pdserve_kv_push_early_starts",
            "Requests started when their pushed KV was complete (started), then attached to by their Decode "
            "(claimed) or ended without it (ended: no Decode in time, DropPush, or a Decode that differed)",
            early, {"started": "num_started", "claimed": "num_claimed", "ended": "num_ended"},
        ))

    def watch_kv_pushes(self, pusher: object) -> None:
        """Export a prefill worker's KV pushes (``kv_transfer.pusher.KVPusher``), read when scraped."""
        self.registry.register(_OutcomeCounts(
            "pdserve_kv_pushes",
            "KV pushed to decode workers while prefilling: confirmed by the decode worker (whole), or failed "
            "(refused, cut off, incomplete, or not set up; that request's KV is pulled instead)",
            pusher, {"confirmed": "num_pushed", "failed": "num_failed"},
        ))

    def prefilled(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prefix_cache_hit_tokens.inc(num_cached_tokens)

    def kv_received(self, transport: str, num_bytes: int, seconds: float) -> None:
        self.kv_transfer_bytes.labels(transport).inc(num_bytes)
        self.kv_transfer_seconds.labels(transport).inc(seconds)


class _EngineStatsCollector(Collector):
    """Gauges from the engine's latest load snapshot, read when scraped rather than copied on every step."""

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.engine_stats = engine_stats

    def collect(self) -> Iterable[Metric]:
        stats = self.engine_stats()
        used = stats.num_total_blocks - stats.num_free_blocks
        yield GaugeMetricFamily("pdserve_engine_requests_running", "Requests in the engine's running batch",
                                value=stats.num_running)
        yield GaugeMetricFamily("pdserve_engine_requests_waiting", "Requests queued for the engine",
                                value=stats.num_waiting)
        # The prefill work ahead: what a prefill autoscaler should follow (deploy/kubernetes).
        yield GaugeMetricFamily("pdserve_engine_queued_tokens",
                                "Tokens admitted or queued and not computed yet (prompt tokens still to prefill)",
                                value=stats.num_queued_tokens)
        blocks = GaugeMetricFamily("pdserve_kv_cache_blocks", "KV cache blocks by state", labels=["state"])
        blocks.add_metric(["free"], stats.num_free_blocks)
        blocks.add_metric(["used"], used)
        yield blocks
        yield GaugeMetricFamily("pdserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
                                value=used / stats.num_total_blocks if stats.num_total_blocks else 0.0)
        # Speculative decoding (vLLM's spec_decode_num_* counters); 0 on an engine that does not speculate.
        yield CounterMetricFamily("pdserve_spec_decode_num_drafts", "Steps that verified a proposal",
                                  value=stats.spec_num_drafts)
        yield CounterMetricFamily("pdserve_spec_decode_num_draft_tokens", "Proposed tokens verified",
                                  value=stats.spec_num_draft_tokens)
        yield CounterMetricFamily("pdserve_spec_decode_num_accepted_tokens", "Proposed tokens the target kept",
                                  value=stats.spec_num_accepted_tokens)


class _ExpiredHandoffs(Collector):
    """Everything a KV handoff held that nobody claimed before the one handoff deadline, in one counter."""

    def __init__(self, engine_stats: Callable[[], EngineStats], timeout_s: float) -> None:
        self.engine_stats = engine_stats
        self.timeout_s = timeout_s
        self.early_starts: object | None = None  # a decode worker's EarlyStarts

    def collect(self) -> Iterable[Metric]:
        stats = self.engine_stats()
        family = CounterMetricFamily(
            "pdserve_kv_handoff_expired",
            "What a KV handoff held that nobody claimed within the handoff deadline (--kv-handoff-timeout), "
            "by what held it: a prefill worker's lease on a finished request's KV (prefill_lease), KV pushed "
            "to a decode worker whose request never came (pushed_kv), a request a decode worker started on "
            "its push that no Decode claimed (early_start)",
            labels=["held"],
        )
        family.add_metric(["prefill_lease"], stats.num_expired_leases)
        family.add_metric(["pushed_kv"], stats.num_expired_pushes)
        family.add_metric(["early_start"], getattr(self.early_starts, "num_expired", 0))
        yield family
        yield GaugeMetricFamily("pdserve_kv_handoff_timeout_seconds",
                                "The handoff deadline: how long a handoff may hold KV that nobody claims",
                                value=self.timeout_s)


class _SpinGovernorCollector(Collector):
    """The OpenMP spin governor's state (``--openmp-spin adaptive``), read when scraped."""

    def __init__(self, governor: SpinGovernor) -> None:
        self.governor = governor

    def collect(self) -> Iterable[Metric]:
        governor = self.governor
        yield GaugeMetricFamily("pdserve_openmp_spin_throttled",
                                "1 while OpenMP threads sleep at once because other processes compute on this "
                                "worker's CPUs, 0 while they spin between parallel regions",
                                value=1 if governor.throttled else 0)
        yield CounterMetricFamily("pdserve_openmp_spin_switches", "Times the OpenMP spin was turned off or on",
                                  value=governor.switches)
        yield GaugeMetricFamily("pdserve_openmp_other_processes_cpus",
                                "CPUs other processes used on this worker's CPUs in the governor's last window",
                                value=governor.others_cpus)


class _OutcomeCounts(Collector):
    """One counter by ``outcome``, each value read from an attribute of ``source`` when scraped."""

    def __init__(self, name: str, documentation: str, source: object, attributes: dict[str, str]) -> None:
        self.name, self.documentation = name, documentation
        self.source, self.attributes = source, attributes  # outcome -> attribute of source

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=["outcome"])
        for outcome, attribute in self.attributes.items():
            family.add_metric([outcome], getattr(self.source, attribute))
        yield family


class MetricsEndpoint:
    """Serves one registry at ``GET /metrics`` from the process's event loop.

    prometheus_client's ``start_http_server`` would add a thread and serve the
    global registry; this answers each connection once, HTTP/1.1 with
    ``Connection: close``, which is all a Prometheus scrape needs.
    """

    HEADER_TIMEOUT_S = 5.0
    MAX_HEADER_LINES = 100

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry, self.host, self.port = registry, host, port
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Bind and serve; the bound port (``port`` 0 picks an ephemeral one)."""
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as error:
            why = "the port is in use" if error.errno == errno.EADDRINUSE else str(error)
            raise OSError(f"could not serve metrics on {self.host}:{self.port}: {why}; "
                          "stop what holds the port or choose another with --metrics-port") from error
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, body, content_type = await asyncio.wait_for(self._respond(reader), self.HEADER_TIMEOUT_S)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode("latin-1") + body
            )
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, ValueError):
            pass  # a slow, vanished or garbled client: nothing to answer
        finally:
            writer.close()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[str, bytes, str]:
        request_line = (await reader.readline()).decode("latin-1").split()
        for _ in range(self.MAX_HEADER_LINES):  # headers are read and ignored
            if (await reader.readline()).strip() == b"":
                break
        if len(request_line) < 2 or request_line[0] != "GET":
            return "405 Method Not Allowed", b"only GET /metrics\n", "text/plain; charset=utf-8"
        if request_line[1].split("?", 1)[0] != "/metrics":
            return "404 Not Found", b"only GET /metrics\n", "text/plain; charset=utf-8"
        return "200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST
