"""Prometheus metrics scraped over HTTP from an in-process gateway and workers, and request ids in log lines."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.service_common.logs import TEXT_FORMAT, JsonFormatter, RequestIdFilter, request_id_context
from tests.conftest import StartInProcessCluster
from tests.support.cluster import ClusterOptions
from tests.support.waiting import wait_until

NUM_BLOCKS = 64
PROMPT = list(range(10, 43))  # 33 tokens: two full blocks of 16, cacheable, and one partial


async def _http_get(port: int, path: str) -> tuple[str, dict[str, str], str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, body = raw.decode().split("\r\n\r\n", 1)
    status, *header_lines = head.split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return status, headers, body


async def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, headers, body = await _http_get(port, "/metrics")
    assert status == "HTTP/1.1 200 OK"
    assert headers["Content-Type"].startswith("text/plain; version=")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.mark.asyncio
async def test_gateway_and_workers_export_exact_metrics_over_http(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=NUM_BLOCKS, metrics=True))
    prefill, decode, gateway, stub = cluster.prefill, cluster.decode, cluster.gateway, cluster.stub
    assert gateway is not None and stub is not None
    params = generation_pb2.SamplingParams(max_tokens=6, temperature=0.0)
    finals = []
    for _ in range(2):  # one after the other: the second finds the first's prompt blocks cached
        responses = [r async for r in stub.Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, sampling_params=params), timeout=60)]
        finals.append(responses[-1])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=[1, 600], sampling_params=params), timeout=60
        ):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f.usage.cached_prompt_tokens for f in finals] == [0, 32]
    decoded = sum(1 for f in finals if f.usage.completion_tokens > 1)  # requests that reached the decode worker
    # Wait for both sides to go idle: leases released, decode requests done.
    await wait_until(
        lambda: not prefill.runtime.engine.leases.request_ids and decode.runtime.async_engine.latest_stats.num_running == 0,
        "every lease released and every decode finished",
    )

    g = await _scrape(gateway.metrics_endpoint.port)
    assert _value(g, "pdserve_requests_total", outcome="ok") == 2.0
    assert _value(g, "pdserve_requests_total", outcome="invalid") == 1.0
    for outcome in ("cancelled", "deadline", "unavailable", "overloaded", "error"):
        assert _value(g, "pdserve_requests_total", outcome=outcome) == 0.0
    assert _value(g, "pdserve_time_to_first_token_seconds_count") == 2.0
    assert _value(g, "pdserve_e2e_request_latency_seconds_count") == 2.0
    assert _value(g, "pdserve_time_per_output_token_seconds_count") == decoded
    assert _value(g, "pdserve_requests_running") == 0.0
    assert _value(g, "pdserve_routing_decisions_total", role="prefill", worker="p0") == 2.0
    assert _value(g, "pdserve_routing_decisions_total", role="decode", worker="d0") == decoded
    assert _value(g, "pdserve_prompt_tokens_total") == 2.0 * len(PROMPT)
    assert _value(g, "pdserve_prefix_cache_hit_tokens_total") == 32.0

    p = await _scrape(prefill.metrics_endpoint.port)
    stats = prefill.runtime.async_engine.latest_stats
    assert _value(p, "pdserve_kv_cache_blocks", state="free") == stats.num_free_blocks
    assert _value(p, "pdserve_kv_cache_blocks", state="used") == NUM_BLOCKS - stats.num_free_blocks
    assert _value(p, "pdserve_kv_cache_usage_ratio") == (NUM_BLOCKS - stats.num_free_blocks) / NUM_BLOCKS
    assert _value(p, "pdserve_engine_requests_running") == 0.0
    assert _value(p, "pdserve_engine_requests_waiting") == 0.0
    assert _value(p, "pdserve_prompt_tokens_total") == 2.0 * len(PROMPT)
    assert _value(p, "pdserve_prefix_cache_hit_tokens_total") == 32.0
    # Both requests' KV went by push, each confirmed by the decode worker.
    assert prefill.servicer.pusher.num_pushed == decode.servicer.kv_pushes == 2
    assert _value(p, "pdserve_kv_pushes_total", outcome="confirmed") == 2.0
    assert _value(p, "pdserve_kv_pushes_total", outcome="failed") == 0.0

    d = await _scrape(decode.metrics_endpoint.port)
    stats = decode.runtime.async_engine.latest_stats
    assert _value(d, "pdserve_kv_cache_blocks", state="free") == stats.num_free_blocks
    assert _value(d, "pdserve_kv_cache_blocks", state="used") == NUM_BLOCKS - stats.num_free_blocks
    assert decode.servicer.kv_bytes_received > 0
    assert _value(d, "pdserve_kv_transfer_bytes_total", transport="grpc") == decode.servicer.kv_bytes_received
    assert _value(d, "pdserve_kv_transfer_seconds_total", transport="grpc") == pytest.approx(
        decode.servicer.kv_receive_seconds)
    early = decode.servicer.early
    # Every pushed request started on its push, and its Decode attached to it.
    assert early.num_claimed == early.num_started == decode.servicer.kv_pushes > 0
    for outcome, count in (("started", early.num_started), ("claimed", early.num_claimed), ("ended", 0)):
        assert _value(d, "pdserve_kv_push_early_starts_total", outcome=outcome) == count

    status, _, _ = await _http_get(gateway.metrics_endpoint.port, "/other")
    assert status == "HTTP/1.1 404 Not Found"


@pytest.mark.asyncio
async def test_lines_logged_while_handling_a_request_carry_its_id(
    llama_checkpoint: Path, caplog: pytest.LogCaptureFixture, start_inprocess_cluster: StartInProcessCluster
) -> None:
    caplog.handler.addFilter(RequestIdFilter())
    caplog.set_level(logging.DEBUG, logger="pdserve.gateway.server")
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=NUM_BLOCKS))
    assert cluster.stub is not None
    request = generation_pb2.GenerateRequest(
        request_id="req-log-1", prompt_token_ids=[1, 2, 3],
        sampling_params=generation_pb2.SamplingParams(max_tokens=2),
    )
    [r async for r in cluster.stub.Generate(request, timeout=60)]
    lines = [r for r in caplog.records if r.getMessage().startswith("generate: 3 prompt tokens")]
    assert [r.request_id for r in lines] == ["req-log-1"]
    assert "request_id=req-log-1: generate: 3 prompt tokens" in logging.Formatter(TEXT_FORMAT).format(lines[0])
    started = [r for r in caplog.records if r.getMessage().startswith("gateway serving on")]
    assert [r.request_id for r in started] == ["-"]


def test_json_lines_carry_the_request_id_set_in_context() -> None:
    logger = logging.getLogger("tests.observability.json")
    with request_id_context("req-7"):
        record = logger.makeRecord(logger.name, logging.INFO, __file__, 1, "hello %s", ("there",), None)
        RequestIdFilter().filter(record)  # as a handler does, at the moment the line is logged
    entry = json.loads(JsonFormatter().format(record))
    assert entry["request_id"] == "req-7"
    assert entry["message"] == "hello there"
    assert entry["level"] == "INFO" and entry["logger"] == "tests.observability.json"


def test_worker_scaling_signals_are_the_engine_snapshot_at_scrape_time() -> None:
    """What the autoscalers in deploy/kubernetes read: queued prompt tokens, running sequences, KV usage."""
    from prometheus_client import generate_latest

    from pdserve.engine.types.outputs import EngineStats
    from pdserve.service_common.metrics import WorkerMetrics

    stats = EngineStats(num_running=3, num_waiting=2, num_queued_tokens=1234, num_free_blocks=25, num_total_blocks=100,
                        num_held=0, num_preemptions=0)
    metrics = WorkerMetrics(lambda: stats)
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in family.samples}
    assert _value(samples, "pdserve_engine_queued_tokens") == 1234.0
    assert _value(samples, "pdserve_engine_requests_running") == 3.0
    assert _value(samples, "pdserve_engine_requests_waiting") == 2.0
    assert _value(samples, "pdserve_kv_cache_usage_ratio") == 0.75


def test_worker_metrics_show_the_openmp_spin_governor() -> None:
    from prometheus_client import generate_latest

    from pdserve.engine.types.outputs import EngineStats
    from pdserve.service_common.metrics import WorkerMetrics
    from pdserve.shared_cores.openmp import SpinGovernor

    stats = EngineStats(num_running=0, num_waiting=0, num_queued_tokens=0, num_free_blocks=1, num_total_blocks=1,
                        num_held=0, num_preemptions=0)
    clock, busy = [0.0], [0.0]
    governor = SpinGovernor(2, 2, lambda size: None, read_busy_s=lambda: busy[0], read_own_s=lambda: 0.0,
                            clock=lambda: clock[0])

    def scrape() -> dict:
        text = generate_latest(WorkerMetrics(lambda: stats, spin_governor=governor).registry).decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    assert _value(scrape(), "pdserve_openmp_spin_throttled") == 0.0
    governor.update()
    clock[0], busy[0] = 0.5, 0.75  # others used 1.5 CPUs
    governor.update()
    try:
        samples = scrape()
        assert _value(samples, "pdserve_openmp_spin_throttled") == 1.0
        assert _value(samples, "pdserve_openmp_spin_switches_total") == 1.0
        assert _value(samples, "pdserve_openmp_other_processes_cpus") == 1.5
    finally:
        governor.close()
    # Without a governor (--openmp-spin libgomp, PASSIVE, one thread) there is nothing to show.
    text = generate_latest(WorkerMetrics(lambda: stats).registry).decode()
    assert "pdserve_openmp" not in text


def test_what_handoffs_held_past_the_one_deadline_is_one_counter_by_holder() -> None:
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from pdserve.engine.types.outputs import EngineStats
    from pdserve.service_common.metrics import WorkerMetrics

    stats = EngineStats(num_running=0, num_waiting=0, num_queued_tokens=0, num_free_blocks=1, num_total_blocks=1,
                        num_held=0, num_preemptions=0, num_expired_leases=2, num_expired_pushes=3)

    def scrape(metrics: WorkerMetrics) -> dict:
        text = generate_latest(metrics.registry).decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    metrics = WorkerMetrics(lambda: stats, handoff_timeout_s=7.5)
    samples = scrape(metrics)
    expired = {holder: samples[("pdserve_kv_handoff_expired_total", frozenset({("held", holder)}))]
               for holder in ("prefill_lease", "pushed_kv", "early_start")}
    assert expired == {"prefill_lease": 2.0, "pushed_kv": 3.0, "early_start": 0.0}
    assert _value(samples, "pdserve_kv_handoff_timeout_seconds") == 7.5
    # A decode worker's early starts that no Decode claimed count in the same counter.
    metrics.watch_early_starts(SimpleNamespace(num_started=4, num_claimed=2, num_ended=2, num_expired=1))
    samples = scrape(metrics)
    assert samples[("pdserve_kv_handoff_expired_total", frozenset({("held", "early_start")}))] == 1.0
