"""A run's figures for people (the printed tables) and for programs (the result JSON)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.backend import ModelDescription
from pdserve.bench.config import BenchConfig, rate_label
from pdserve.bench.metrics import BenchMetrics, LatencyStats
from pdserve.bench.runner import RunOutcome

WIDTH = 50
LATENCY_SECTIONS = (
    ("Time to First Token", "TTFT", "ttft"),
    ("Time per Output Token (excl. 1st token)", "TPOT", "tpot"),
    ("Inter-token Latency", "ITL", "itl"),
    ("End-to-end Latency", "E2EL", "e2el"),
)


@dataclass(frozen=True)
class RunResult:
    """One run's records and the figures computed from them."""

    outcome: RunOutcome
    metrics: BenchMetrics


def format_run_table(result: RunResult) -> str:
    metrics = result.metrics
    rows = [
        ("Request rate (req/s)", rate_label(result.outcome.request_rate)),
        ("Successful requests", str(metrics.completed)),
        ("Failed requests", str(metrics.failed)),
        *((f"  failed with {code}", str(count)) for code, count in sorted(metrics.errors_by_code.items())),
        ("Benchmark duration (s)", f"{metrics.duration_s:.2f}"),
        ("Total input tokens", str(metrics.total_prompt_tokens)),
        ("Total generated tokens", str(metrics.total_output_tokens)),
        ("Cached prompt tokens", str(metrics.total_cached_prompt_tokens)),
        ("Prefix cache hit rate (%)", _number(_percent(metrics.prefix_cache_hit_rate))),
        ("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.2f}"),
    ]
    if metrics.goodput is not None:
        rows.append(("Request goodput (req/s)", f"{metrics.goodput:.2f}"))
    if metrics.spec_decode_acceptance_rate is not None:
        rows.append(("Spec decode acceptance rate (%)", _number(_percent(metrics.spec_decode_acceptance_rate))))
        rows.append(("Spec decode mean accepted length", _number(metrics.spec_decode_mean_accepted_length)))
    lines = [_rule(" Serving Benchmark Result ", "="), *(_row(name, value) for name, value in rows)]
    for title, short, attribute in LATENCY_SECTIONS:
        stats: LatencyStats = getattr(metrics, attribute)
        lines.append(_rule(title, "-"))
        lines += [
            _row(f"Mean {short} (ms)", _number(stats.mean_ms)),
            _row(f"Median {short} (ms)", _number(stats.median_ms)),
            _row(f"P90 {short} (ms)", _number(stats.p90_ms)),
            _row(f"P99 {short} (ms)", _number(stats.p99_ms)),
        ]
    if metrics.first_errors:
        lines.append(_rule("First errors", "-"))
        lines += list(metrics.first_errors)
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_sweep_table(results: Sequence[RunResult]) -> str:
    header = ("rate", "ok", "failed", "req/s", "goodput", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "E2EL p99")
    rows = [header]
    for result in results:
        metrics = result.metrics
        rows.append((
            rate_label(result.outcome.request_rate),
            str(metrics.completed),
            str(metrics.failed),
            f"{metrics.request_throughput:.2f}",
            _number(metrics.goodput),
            f"{metrics.output_throughput:.2f}",
            _number(metrics.ttft.median_ms),
            _number(metrics.ttft.p99_ms),
            _number(metrics.tpot.median_ms),
            _number(metrics.e2el.p99_ms),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(["Sweep (latencies in ms)", *lines])


def result_document(config: BenchConfig, model: ModelDescription, results: Sequence[RunResult]) -> dict[str, Any]:
    """The result JSON: the configuration, the model, and per run its metrics and every request's record."""
    return {
        "config": _jsonable(config),
        "model": _jsonable(model),
        "runs": [
            {
                "request_rate": _jsonable(result.outcome.request_rate),
                "metrics": _jsonable(result.metrics),
                "requests": _jsonable(result.outcome.records),
            }
            for result in results
        ],
    }


def write_result_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: the file must be strict JSON (infinite rates are written as "inf").
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else fraction * 100


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _row(name: str, value: str) -> str:
    return f"{name + ':':<{WIDTH - 10}}{value:>10}"


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{WIDTH}}"
