"""PNG plots of a benchmark: latency CDFs per run, throughput and goodput against request rate.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so nothing
touches a display or pyplot's global figure registry. matplotlib is imported
only here, only when plots are asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench.config import rate_label
from pdserve.bench.metrics import LatencySamples, latency_samples
from pdserve.bench.report import RunResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100


def write_plots(results: Sequence[RunResult], plot_dir: Path) -> list[Path]:
    """A latency-CDF plot per run, plus the sweep plot when there are several runs; returns the files."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for result in results:
        label = rate_label(result.outcome.request_rate)
        path = plot_dir / f"latency_cdf_rate_{label}.png"
        plot_latency_cdfs(latency_samples(result.outcome.records), path, f"Latency CDFs at {label} req/s")
        paths.append(path)
    if len(results) > 1:
        path = plot_dir / "sweep_throughput.png"
        plot_sweep(results, path)
        paths.append(path)
    return paths


def plot_latency_cdfs(samples: LatencySamples, path: Path, title: str) -> None:
    """Empirical CDFs of TTFT, TPOT, ITL and end-to-end latency, one panel each."""
    figure = _figure(10, 7)
    figure.suptitle(title)
    panels = (
        ("TTFT", samples.ttft_ms),
        ("TPOT", samples.tpot_ms),
        ("ITL", samples.itl_ms),
        ("End-to-end latency", samples.e2el_ms),
    )
    for position, (name, values) in enumerate(panels, start=1):
        axes = figure.add_subplot(2, 2, position)
        axes.set_title(name)
        axes.set_xlabel("ms")
        axes.set_ylabel("fraction of samples")
        axes.set_ylim(0, 1.02)
        axes.grid(True, alpha=0.3)
        if not values:
            axes.text(0.5, 0.5, "no samples", ha="center", va="center", transform=axes.transAxes)
            continue
        ordered = sorted(values)
        # Start at (min, 0) so the curve rises from zero at the smallest sample.
        fractions = [i / len(ordered) for i in range(len(ordered) + 1)]
        axes.step([ordered[0], *ordered], fractions, where="post")
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)


def plot_sweep(results: Sequence[RunResult], path: Path) -> None:
    """Request throughput and goodput (left), output token throughput (right) against the offered rate."""
    positions, labels = _rate_positions([r.outcome.request_rate for r in results])
    figure = _figure(11, 4.5)
    requests_axes = figure.add_subplot(1, 2, 1)
    requests_axes.plot(positions, [r.metrics.request_throughput for r in results], marker="o", label="throughput")
    goodputs = [r.metrics.goodput for r in results if r.metrics.goodput is not None]
    if len(goodputs) == len(results):  # goodput exists only when SLOs were given
        requests_axes.plot(positions, goodputs, marker="s", label="goodput (all SLOs met)")
    requests_axes.set_ylabel("completed requests / s")
    requests_axes.legend()
    tokens_axes = figure.add_subplot(1, 2, 2)
    tokens_axes.plot(positions, [r.metrics.output_throughput for r in results], marker="o", color="tab:green")
    tokens_axes.set_ylabel("output tokens / s")
    for axes in (requests_axes, tokens_axes):
        axes.set_xlabel("offered request rate (req/s)")
        axes.set_xticks(positions, labels)
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)


def _rate_positions(rates: Sequence[float]) -> tuple[list[float], list[str]]:
    # An infinite rate cannot sit on a numeric axis: put it one step past the largest finite rate.
    finite = [rate for rate in rates if math.isfinite(rate)]
    inf_position = max(finite) * 1.5 if finite else 1.0
    return [rate if math.isfinite(rate) else inf_position for rate in rates], [rate_label(rate) for rate in rates]


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise RuntimeError("--plot-dir needs matplotlib: pip install 'matplotlib>=3.7'") from error
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure
