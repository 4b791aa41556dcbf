"""Serving metrics from per-request records: pure arithmetic, no clock and no I/O.

Definitions (those of ``vllm bench serve``), over successful requests only:

- TTFT: first token-carrying response minus the request's start.
- E2EL (end-to-end latency): the stream's close minus the request's start.
- TPOT: ``(e2el - ttft) / (output_tokens - 1)`` per request; a request with
  one output token has none (and meets any TPOT SLO, as in vLLM's goodput).
- ITL: every gap between two successive token-carrying responses of one
  request. A response carrying k tokens is one chunk: it adds one gap, not
  k - 1 zero gaps, so ITL measures what a streaming client sees.
- Mean, median and the 90th/99th percentiles of each, in milliseconds;
  percentiles use numpy's default method ("linear": interpolate between the
  two nearest ranks). An empty sample (e.g. no request had two tokens) has
  ``None`` for every statistic.
- Throughputs divide by the run's duration: completed requests, their output
  tokens, and their prompt plus output tokens.
- Prefix-cache hit rate: sum of cached prompt tokens over sum of prompt tokens.
- Goodput: completed requests per second meeting every given SLO (``<=``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from pdserve.bench.record import RequestRecord

MAX_ERROR_MESSAGES = 5


@dataclass(frozen=True)
class SLOs:
    """Latency objectives in milliseconds; ``None`` leaves a metric unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms)):
            if value is not None and not value > 0:
                raise ValueError(f"the {name} SLO must be a positive number of milliseconds, got {value}")

    @property
    def is_set(self) -> bool:
        return any(value is not None for value in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency sample, in milliseconds."""

    count: int
    mean_ms: float | None
    median_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True)
class LatencySamples:
    """Every latency value of a run, in milliseconds, in request order (the CDF plots draw these)."""

    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    itl_ms: tuple[float, ...]
    e2el_ms: tuple[float, ...]


@dataclass(frozen=True)
class BenchMetrics:
    """Every figure of one run."""

    duration_s: float
    completed: int
    failed: int
    errors_by_code: dict[str, int]
    first_errors: tuple[str, ...]  # up to MAX_ERROR_MESSAGES distinct "CODE: message", earliest first
    total_prompt_tokens: int
    total_output_tokens: int
    total_cached_prompt_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    prefix_cache_hit_rate: float | None  # None when no prompt token was counted
    good_requests: int | None  # None when no SLO was given
    goodput: float | None  # good requests / s
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    # Speculative decoding over the completed requests: accepted / verified proposed tokens, and tokens per
    # verifying step (accepted + the target's own); None when no request was speculated on.
    spec_decode_acceptance_rate: float | None = None
    spec_decode_mean_accepted_length: float | None = None


def ttft_s(record: RequestRecord) -> float:
    return record.chunk_times[0] - record.start


def e2el_s(record: RequestRecord) -> float:
    return record.end - record.start


def tpot_s(record: RequestRecord) -> float | None:
    if record.output_tokens < 2:
        return None
    return (e2el_s(record) - ttft_s(record)) / (record.output_tokens - 1)


def itls_s(record: RequestRecord) -> list[float]:
    return [later - earlier for earlier, later in pairwise(record.chunk_times)]


def latency_samples(records: Sequence[RequestRecord]) -> LatencySamples:
    done = [r for r in records if r.ok]
    tpots = [t for t in (tpot_s(r) for r in done) if t is not None]
    return LatencySamples(
        ttft_ms=tuple(ttft_s(r) * 1000 for r in done),
        tpot_ms=tuple(t * 1000 for t in tpots),
        itl_ms=tuple(gap * 1000 for r in done for gap in itls_s(r)),
        e2el_ms=tuple(e2el_s(r) * 1000 for r in done),
    )


def latency_stats(values_ms: Sequence[float]) -> LatencyStats:
    if not values_ms:
        return LatencyStats(count=0, mean_ms=None, median_ms=None, p90_ms=None, p99_ms=None)
    values = np.asarray(values_ms, dtype=np.float64)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])  # numpy's default method: linear
    return LatencyStats(
        count=len(values), mean_ms=float(values.mean()), median_ms=float(p50), p90_ms=float(p90), p99_ms=float(p99)
    )


def meets_slos(record: RequestRecord, slos: SLOs) -> bool:
    if not record.ok:
        return False
    if slos.ttft_ms is not None and ttft_s(record) * 1000 > slos.ttft_ms:
        return False
    tpot = tpot_s(record)
    if slos.tpot_ms is not None and tpot is not None and tpot * 1000 > slos.tpot_ms:
        return False
    return slos.e2el_ms is None or e2el_s(record) * 1000 <= slos.e2el_ms


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slos: SLOs = SLOs()) -> BenchMetrics:
    """Every figure of a run lasting ``duration_s`` seconds whose requests are ``records``."""
    if not duration_s > 0:
        raise ValueError(f"a run's duration must be positive, got {duration_s}")
    done = [r for r in records if r.ok]
    failed = sorted((r for r in records if not r.ok), key=lambda r: (r.end, r.index))
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    cached_tokens = sum(r.cached_prompt_tokens for r in done)
    good = sum(meets_slos(r, slos) for r in done) if slos.is_set else None
    drafts = sum(r.spec_decode_drafts for r in done)
    draft_tokens = sum(r.spec_decode_draft_tokens for r in done)
    accepted = sum(r.spec_decode_accepted_tokens for r in done)
    samples = latency_samples(done)
    return BenchMetrics(
        duration_s=duration_s,
        completed=len(done),
        failed=len(failed),
        errors_by_code=dict(Counter(r.error.code for r in failed if r.error is not None)),
        first_errors=_first_distinct_errors(failed),
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        total_cached_prompt_tokens=cached_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_s,
        prefix_cache_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else None,
        good_requests=good,
        goodput=good / duration_s if good is not None else None,
        ttft=latency_stats(samples.ttft_ms),
        tpot=latency_stats(samples.tpot_ms),
        itl=latency_stats(samples.itl_ms),
        e2el=latency_stats(samples.e2el_ms),
        spec_decode_acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        spec_decode_mean_accepted_length=1 + accepted / drafts if drafts else None,
    )


def _first_distinct_errors(failed: Sequence[RequestRecord]) -> tuple[str, ...]:
    # A broken server fails every request the same way: distinct messages say more than the first N.
    messages: list[str] = []
    for record in failed:
        assert record.error is not None
        message = f"{record.error.code}: {record.error.message}"
        if message not in messages:
            messages.append(message)
        if len(messages) == MAX_ERROR_MESSAGES:
            break
    return tuple(messages)
