"""The serving comparisons of BENCHMARKS.md, side by side in one run, driven by ``pdserve bench``.

    python -m benchmarks.serving_comparisons [--out-dir DIR] [--quick]

1. Colocated (one worker doing prefill and decode) against disaggregated 1P+1D,
   across request rates: TTFT, TPOT, ITL, throughput, goodput.
2. Prefix reuse: a 1,000-token shared system prompt with short distinct
   questions, prefix caching on (warm after the first request) against off.
3. Routing: 2 prefill workers, 4 shared prefixes, prefix-aware against round-robin.
4. The offline reference: transformers' continuous batching on the same
   prompts as the all-at-once run of (1).

Every cluster is a fresh ``pdserve up``-style local cluster of the default
model in float32 on this machine; each run of ``pdserve bench`` writes its JSON
into ``--out-dir``, and a summary goes to ``summary.json`` and ``sweep.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.launcher import ClusterConfig, LocalCluster

SLOS = ["ttft:3000", "tpot:250"]


def _bench(endpoint: str, out: Path, *args: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "pdserve", "bench", "--target", endpoint, "--result-json", str(out),
               "--ignore-eos", "--disable-tqdm", "--goodput", *SLOS, *args]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _metrics(result: dict[str, Any]) -> dict[str, Any]:
    return result["runs"][0]["metrics"]


def _cluster(**overrides: Any) -> LocalCluster:
    values: dict[str, Any] = {"dtype": "float32", "port": 0, "engine_args": ("--num-kv-blocks", "2048"),
                              "redis_prefix": f"pdserve-bench-{time.time_ns()}",
                              # The layouts as BENCHMARKS.md measured them (before conditional disaggregation).
                              "disaggregation": "always"}
    values.update(overrides)
    return LocalCluster(ClusterConfig(**values))


def layouts_sweep(out_dir: Path, rates: list[float], num_prompts: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {}
    for name, layout in (("colocated", {"colocated_workers": 1}), ("disaggregated", {})):
        rows = []
        with _cluster(**layout) as cluster:
            for index, rate in enumerate(rates):
                # A different seed per rate: no run finds an earlier run's prompts in the cache.
                result = _bench(cluster.endpoint, out_dir / f"sweep_{name}_{rate}.json", "--workload", "random",
                                "--num-prompts", str(num_prompts), "--input-len", "128", "--range-ratio", "0.5",
                                "--output-len", "32", "--request-rate", str(rate), "--seed", str(100 + index))
                rows.append({"rate": rate, **_metrics(result)})
        results[name] = rows
    return results


def prefix_reuse(out_dir: Path, num_prompts: int) -> dict[str, dict[str, Any]]:
    results = {}
    args = ("--workload", "prefix", "--num-prefixes", "1", "--prefix-len", "1000", "--input-len", "16",
            "--output-len", "8", "--num-prompts", str(num_prompts), "--request-rate", "0.5", "--seed", "7")
    for name, engine_args in (("prefix_caching_on", ()), ("prefix_caching_off", ("--no-prefix-caching",))):
        with _cluster(engine_args=("--num-kv-blocks", "2048", *engine_args)) as cluster:
            results[name] = _metrics(_bench(cluster.endpoint, out_dir / f"prefix_{name}.json", *args))
    return results


def routing(out_dir: Path, num_prompts: int) -> dict[str, dict[str, Any]]:
    results = {}
    args = ("--workload", "prefix", "--num-prefixes", "4", "--prefix-len", "256", "--input-len", "32",
            "--output-len", "8", "--num-prompts", str(num_prompts), "--request-rate", "2", "--seed", "11",
            "--prefix-order", "random")
    for policy in ("prefix", "round_robin"):
        with _cluster(prefill_workers=2, routing=policy) as cluster:
            results[policy] = _metrics(_bench(cluster.endpoint, out_dir / f"routing_{policy}.json", *args))
    return results


def hf_reference(num_prompts: int, seed: int) -> dict[str, float]:
    """transformers' generate_batch on the prompts of the sweep's all-at-once run."""
    import torch  # noqa: F401 - loaded here only

    from benchmarks.hf_baselines import continuous_batching_config, load_hf_model, run_hf_continuous
    from benchmarks.workload import Workload
    from pdserve.engine.default_model import ensure_default_model
    from pdserve.bench.workload import WorkloadConfig, build_workload

    requests = build_workload(
        WorkloadConfig(kind="random", num_prompts=num_prompts, input_len=128, output_len=32, range_ratio=0.5, seed=seed),
        49152,
    )
    workload = Workload(prompts=tuple(r.prompt_token_ids for r in requests), output_len=32)
    model = load_hf_model(ensure_default_model())
    result = run_hf_continuous(model, workload, continuous_batching_config(workload, 16, 2048, 256))
    return {"wall_s": result.wall_s, "output_tokens_per_s": result.num_output_tokens / result.wall_s}


def _plot(sweep: dict[str, list[dict[str, Any]]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 3.6))
    FigureCanvasAgg(figure)
    panels = [("output_throughput", "output tokens/s"), ("goodput", "goodput (req/s)"),
              (("ttft", "median_ms"), "TTFT median (ms)"), (("tpot", "median_ms"), "TPOT median (ms)")]
    for index, (key, label) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), index + 1)
        for name, rows in sweep.items():
            finite = [r for r in rows if math.isfinite(r["rate"])]
            values = [r[key[0]][key[1]] if isinstance(key, tuple) else r[key] for r in finite]
            axes.plot([r["rate"] for r in finite], values, marker="o", label=name)
        axes.set_xlabel("request rate (req/s)")
        axes.set_title(label, fontsize=9)
        axes.grid(alpha=0.3)
    figure.axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--rates", default="0.5,1,2,4,inf")
    parser.add_argument("--num-prompts", type=int, default=16)
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    summary: dict[str, Any] = {"sweep": layouts_sweep(out_dir, rates, args.num_prompts)}
    summary["prefix_reuse"] = prefix_reuse(out_dir, 12)
    summary["routing"] = routing(out_dir, 32)
    if math.inf in rates:
        summary["hf_continuous_reference"] = hf_reference(args.num_prompts, 100 + rates.index(math.inf))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    _plot(summary["sweep"], out_dir / "sweep.png")
    print(json.dumps(summary, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
