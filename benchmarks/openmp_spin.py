"""Two local clusters side by side, one per ``--openmp-spin`` setting, driven with the same bursts in turn.

    python -m benchmarks.openmp_spin [--disaggregation always] [--rounds 6] [--num-prompts 32] [--json out.json]

Both clusters (``pdserve up``'s default 1P+1D, float32, KV over grpc) stay up
through the run; one computes while the other idles (its OpenMP threads asleep,
its engine threads waiting on their queues). Each round sends the same burst
(``cluster_throughput``'s workload, prompts of the round's own, all at once) to
one cluster, then to the other, the order alternated from round to round so
that a machine that speeds up or slows down favours neither. ``adaptive``
workers govern their spin themselves (pdserve/shared_cores/openmp.py); ``libgomp`` workers
leave it to libgomp, and ``pdserve up`` then starts them with
``OMP_WAIT_POLICY=PASSIVE`` (the engines share the cores). Reports output
tokens/s per round and the per-round ratio adaptive / libgomp, with its median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from benchmarks.cluster_throughput import VOCAB_SIZE, _drive
from benchmarks.workload import make_warmup_workload, make_workload
from pdserve.launcher import ClusterConfig, LocalCluster

SETTINGS = ("adaptive", "libgomp")


def round_order(index: int) -> tuple[str, str]:
    """adaptive first in even rounds, libgomp first in odd ones."""
    return SETTINGS if index % 2 == 0 else SETTINGS[::-1]


def summarize(rates: dict[str, list[float]]) -> dict[str, object]:
    """Per-round ratios adaptive / libgomp and the medians of the ratios and of each side's rate."""
    ratios = [a / b for a, b in zip(rates["adaptive"], rates["libgomp"], strict=True)]
    return {
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "median_tokens_per_s": {name: statistics.median(values) for name, values in rates.items()},
    }


def _config(spin: str, disaggregation: str, num_kv_blocks: int) -> ClusterConfig:
    return ClusterConfig(
        dtype="float32", port=0, kv_transport="grpc", disaggregation=disaggregation,
        engine_args=("--num-kv-blocks", str(num_kv_blocks), "--openmp-spin", spin),
        redis_prefix=f"pdserve-bench-spin-{spin}-{time.time_ns()}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--disaggregation", default="always", choices=["always", "never", "auto"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=5000)
    parser.add_argument("--json", default=None, help="also write the rounds and the summary here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")

    rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with LocalCluster(_config("adaptive", args.disaggregation, args.num_kv_blocks)) as adaptive, \
            LocalCluster(_config("libgomp", args.disaggregation, args.num_kv_blocks)) as libgomp:
        clusters = {"adaptive": adaptive, "libgomp": libgomp}
        first = make_workload(args.num_prompts, 32, 256, args.output_len, VOCAB_SIZE, args.seed)
        warmup = make_warmup_workload(first, VOCAB_SIZE, args.seed)
        for cluster in clusters.values():
            asyncio.run(_drive(cluster.endpoint, warmup.prompt_lists(), warmup.output_len))
        for i in range(args.rounds):
            workload = first if i == 0 else make_workload(args.num_prompts, 32, 256, args.output_len, VOCAB_SIZE,
                                                          args.seed + i)
            for name in round_order(i):
                results, wall = asyncio.run(_drive(clusters[name].endpoint, workload.prompt_lists(),
                                                   workload.output_len))
                rate = sum(len(r["tokens"]) for r in results) / wall
                rates[name].append(rate)
                print(f"round {i + 1} {name}: {wall:.2f} s, {rate:.1f} output tokens/s", flush=True)
    summary = summarize(rates)
    print(f"{args.disaggregation}: adaptive / libgomp per round "
          f"{', '.join(f'{r:.2f}' for r in summary['ratios'])}; median {summary['median_ratio']:.3f} "
          f"(median tok/s: adaptive {summary['median_tokens_per_s']['adaptive']:.1f}, "
          f"libgomp {summary['median_tokens_per_s']['libgomp']:.1f})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"disaggregation": args.disaggregation, "rates": rates, **summary}, out, indent=2)


if __name__ == "__main__":
    main()
