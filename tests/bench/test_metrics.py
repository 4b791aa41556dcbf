"""Metric arithmetic on synthetic timelines, checked against values computed by hand.

Percentiles are numpy's default ("linear"): the q-th percentile of n sorted
values sits at rank q/100 * (n - 1), interpolated between its two neighbours.
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.bench.metrics import SLOs, compute_metrics, latency_samples, latency_stats
from pdserve.bench.record import RequestError, RequestRecord


def _record(index: int, start: float, chunks: list[tuple[float, int]], end: float, prompt: int, output: int,
            cached: int, error: RequestError | None = None) -> RequestRecord:
    return RequestRecord(
        index=index,
        start=start,
        end=end,
        chunk_times=tuple(t for t, _ in chunks),
        chunk_tokens=tuple(n for _, n in chunks),
        prompt_tokens=prompt,
        output_tokens=output,
        cached_prompt_tokens=cached,
        error=error,
    )


# Three successes, two failures, over a 2 s run. Latencies in ms:
#   r0: TTFT 100, E2EL 400, TPOT (400-100)/3 = 100, ITLs 50, 150, 100
#   r1: TTFT 200, E2EL 350, TPOT (350-200)/3 = 50,  ITLs 20, 80 (one chunk carries 2 tokens: one gap, not two)
#   r2: TTFT 400, E2EL 500 (the stream closes 100 ms after its only token), one token: no TPOT, no ITL
RECORDS = (
    _record(0, 0.0, [(0.1, 1), (0.15, 1), (0.3, 1), (0.4, 1)], 0.4, prompt=100, output=4, cached=64),
    _record(1, 0.5, [(0.7, 1), (0.72, 2), (0.8, 1)], 0.85, prompt=50, output=4, cached=0),
    _record(2, 1.0, [(1.4, 1)], 1.5, prompt=30, output=1, cached=16),
    # Failures: the one that streamed a token before failing must not count anywhere but "failed".
    _record(3, 1.1, [(1.11, 1)], 1.2, prompt=0, output=0, cached=0,
            error=RequestError("UNAVAILABLE", "no decode worker is available")),
    _record(4, 1.1, [], 1.15, prompt=0, output=0, cached=0, error=RequestError("DEADLINE_EXCEEDED", "deadline")),
)
EXACT = {"rel": 1e-12}


def test_latency_statistics_use_successful_requests_and_linear_percentiles() -> None:
    metrics = compute_metrics(RECORDS, duration_s=2.0)
    # TTFT [100, 200, 400]: p90 at rank 1.8 = 200 + 0.8 * 200, p99 at rank 1.98 = 200 + 0.98 * 200.
    assert metrics.ttft.count == 3
    assert metrics.ttft.mean_ms == pytest.approx(700 / 3, **EXACT)
    assert metrics.ttft.median_ms == pytest.approx(200, **EXACT)
    assert metrics.ttft.p90_ms == pytest.approx(360, **EXACT)
    assert metrics.ttft.p99_ms == pytest.approx(396, **EXACT)
    # TPOT [100, 50] (r2 has one token): p90 at rank 0.9 = 50 + 0.9 * 50.
    assert (metrics.tpot.count, metrics.tpot.mean_ms, metrics.tpot.median_ms) == (2, pytest.approx(75, **EXACT),
                                                                                  pytest.approx(75, **EXACT))
    assert metrics.tpot.p90_ms == pytest.approx(95, **EXACT)
    assert metrics.tpot.p99_ms == pytest.approx(99.5, **EXACT)
    # ITL sorted [20, 50, 80, 100, 150]: p90 at rank 3.6 = 100 + 0.6 * 50, p99 at rank 3.96 = 100 + 0.96 * 50.
    assert metrics.itl.count == 5
    assert metrics.itl.mean_ms == pytest.approx(80, **EXACT)
    assert metrics.itl.median_ms == pytest.approx(80, **EXACT)
    assert metrics.itl.p90_ms == pytest.approx(130, **EXACT)
    assert metrics.itl.p99_ms == pytest.approx(148, **EXACT)
    # E2EL [350, 400, 500]: p90 at rank 1.8 = 400 + 0.8 * 100.
    assert metrics.e2el.count == 3
    assert metrics.e2el.mean_ms == pytest.approx(1250 / 3, **EXACT)
    assert metrics.e2el.median_ms == pytest.approx(400, **EXACT)
    assert metrics.e2el.p90_ms == pytest.approx(480, **EXACT)
    assert metrics.e2el.p99_ms == pytest.approx(498, **EXACT)


def test_counts_throughputs_and_hit_rate_count_only_completed_requests() -> None:
    metrics = compute_metrics(RECORDS, duration_s=2.0)
    assert (metrics.completed, metrics.failed) == (3, 2)
    assert metrics.total_prompt_tokens == 180
    assert metrics.total_output_tokens == 9
    assert metrics.total_cached_prompt_tokens == 80
    assert metrics.request_throughput == pytest.approx(1.5, **EXACT)
    assert metrics.output_throughput == pytest.approx(4.5, **EXACT)
    assert metrics.total_token_throughput == pytest.approx(94.5, **EXACT)  # (180 + 9) / 2
    assert metrics.prefix_cache_hit_rate == pytest.approx(80 / 180, **EXACT)
    assert (metrics.good_requests, metrics.goodput) == (None, None)  # no SLO given


def test_failures_are_counted_by_status_with_their_messages_earliest_first() -> None:
    metrics = compute_metrics(RECORDS, duration_s=2.0)
    assert metrics.errors_by_code == {"UNAVAILABLE": 1, "DEADLINE_EXCEEDED": 1}
    assert metrics.first_errors == ("DEADLINE_EXCEEDED: deadline", "UNAVAILABLE: no decode worker is available")


def test_repeated_error_messages_are_listed_once() -> None:
    error = RequestError("UNAVAILABLE", "down")
    records = [_record(i, 0.0, [], 0.1 * (i + 1), 0, 0, 0, error=error) for i in range(7)]
    metrics = compute_metrics(records, duration_s=1.0)
    assert (metrics.failed, metrics.errors_by_code) == (7, {"UNAVAILABLE": 7})
    assert metrics.first_errors == ("UNAVAILABLE: down",)


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        (SLOs(ttft_ms=250, tpot_ms=80), 1),  # r0 misses TPOT (100), r2 misses TTFT (400): only r1
        (SLOs(e2el_ms=450), 2),  # r2's 500 ms misses
        (SLOs(tpot_ms=80), 2),  # r2 has one token, so no TPOT: it meets the TPOT SLO (vLLM's rule)
        (SLOs(ttft_ms=200, e2el_ms=400), 2),  # bounds are inclusive: r0 (100, 400) and r1 (200, 350)
        (SLOs(ttft_ms=10_000), 3),  # the failed requests never count, however fast they failed
    ],
)
def test_goodput_counts_completed_requests_meeting_every_slo(slos: SLOs, good: int) -> None:
    metrics = compute_metrics(RECORDS, duration_s=2.0, slos=slos)
    assert metrics.good_requests == good
    assert metrics.goodput == pytest.approx(good / 2.0, **EXACT)


def test_samples_are_in_milliseconds_in_request_order() -> None:
    samples = latency_samples(RECORDS)
    assert samples.ttft_ms == pytest.approx((100, 200, 400), **EXACT)
    assert samples.tpot_ms == pytest.approx((100, 50), **EXACT)
    assert samples.itl_ms == pytest.approx((50, 150, 100, 20, 80), **EXACT)
    assert samples.e2el_ms == pytest.approx((400, 350, 500), **EXACT)


def test_a_run_where_everything_failed_has_empty_statistics_and_zero_throughput() -> None:
    metrics = compute_metrics(RECORDS[3:], duration_s=1.0, slos=SLOs(ttft_ms=100))
    assert (metrics.completed, metrics.failed) == (0, 2)
    assert (metrics.request_throughput, metrics.output_throughput) == (0.0, 0.0)
    assert (metrics.prefix_cache_hit_rate, metrics.good_requests, metrics.goodput) == (None, 0, 0.0)
    assert metrics.ttft == latency_stats([])
    assert (metrics.ttft.count, metrics.ttft.mean_ms, metrics.ttft.p99_ms) == (0, None, None)


def test_a_single_sample_is_every_statistic() -> None:
    stats = latency_stats([12.5])
    assert (stats.count, stats.mean_ms, stats.median_ms, stats.p90_ms, stats.p99_ms) == (1, 12.5, 12.5, 12.5, 12.5)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="duration must be positive"):
        compute_metrics(RECORDS, duration_s=0.0)
    with pytest.raises(ValueError, match="ttft SLO must be a positive"):
        SLOs(ttft_ms=0)
    with pytest.raises(ValueError, match="succeeded without a single token"):
        _record(9, 0.0, [], 1.0, 1, 0, 0)


def test_spec_decode_acceptance_counts_completed_requests_only() -> None:
    records = [
        dataclasses.replace(RECORDS[0], spec_decode_drafts=2, spec_decode_draft_tokens=8, spec_decode_accepted_tokens=6),
        dataclasses.replace(RECORDS[1], spec_decode_drafts=1, spec_decode_draft_tokens=4, spec_decode_accepted_tokens=1),
        RECORDS[2],
        dataclasses.replace(RECORDS[3], spec_decode_drafts=5, spec_decode_draft_tokens=20, spec_decode_accepted_tokens=20),
    ]
    metrics = compute_metrics(records, duration_s=2.0)
    assert metrics.spec_decode_acceptance_rate == pytest.approx(7 / 12, **EXACT)
    assert metrics.spec_decode_mean_accepted_length == pytest.approx(1 + 7 / 3, **EXACT)
    assert compute_metrics(RECORDS, duration_s=2.0).spec_decode_acceptance_rate is None


def test_the_run_table_prints_acceptance_only_when_speculation_ran() -> None:
    from pdserve.bench.report import RunResult, format_run_table
    from pdserve.bench.runner import RunOutcome

    records = (
        dataclasses.replace(RECORDS[0], spec_decode_drafts=2, spec_decode_draft_tokens=8, spec_decode_accepted_tokens=6),
        RECORDS[1],
    )
    outcome = RunOutcome(request_rate=float("inf"), duration_s=2.0, records=records)
    table = format_run_table(RunResult(outcome, compute_metrics(records, duration_s=2.0)))
    assert "Spec decode acceptance rate (%):" in table and table.split("Spec decode acceptance rate (%):")[1].split()[0] == "75.00"
    assert table.split("Spec decode mean accepted length:")[1].split()[0] == "4.00"
    plain = RunOutcome(request_rate=float("inf"), duration_s=2.0, records=RECORDS[:2])
    assert "Spec decode" not in format_run_table(RunResult(plain, compute_metrics(RECORDS[:2], duration_s=2.0)))
