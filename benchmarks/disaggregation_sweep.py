"""Conditional disaggregation against both fixed layouts: a `pdserve bench` rate sweep on a mixed workload.

    python -m benchmarks.disaggregation_sweep [--rates 0.25,0.5,1] [--num-prompts 16] [--out-dir DIR]

Three local clusters of the default model (float32, one torch thread per worker),
one after the other (or, with ``--all-at-once``, started together and driven in
turn at each rate, so that every rate's three runs sit side by side in time):

- colocated: one worker prefilling and decoding on one engine (``--disaggregation never``);
- disaggregated: 1 prefill + 1 decode worker, every prompt prefilled remotely (``always``);
- auto: the same 1P+1D with ``--disaggregation auto``.

Each run is a `pdserve bench` of the mixed workload (short chat turns, long
documents, questions on shared prefixes) with Poisson arrivals and a new seed per
rate. The auto gateway's route counts per run come from its /metrics. The verdict
per rate: auto's goodput >= the better of the other two, its TTFT
p50 within 10% of colocated's and its TPOT p99 within 10% of disaggregated's.
Clusters are stopped by PID (``LocalCluster.stop``) even when a run fails.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pdserve.launcher import ClusterConfig, LocalCluster

# Milliseconds: a long document's prefill fits the first, a stream stalled by one misses the second.
SLOS = ("ttft:5000", "tpot:150")
LAYOUTS = {
    "colocated": {"colocated_workers": 1, "disaggregation": "never"},
    "disaggregated": {"disaggregation": "always"},
    "auto": {"disaggregation": "auto"},
}
WORKLOAD = ("--workload", "mixed", "--input-len", "64", "--range-ratio", "0.25", "--long-len", "1024",
            "--num-prefixes", "2", "--prefix-len", "512", "--mix", "0.6,0.2,0.2", "--output-len", "32")
ROUTE_LINE = re.compile(r'^pdserve_gateway_prefill_route_total\{(.*)\} (\S+)$', re.MULTILINE)
LABEL = re.compile(r'(\w+)="(\w*)"')


def _cluster(name: str, threads: int, num_kv_blocks: int) -> LocalCluster:
    return LocalCluster(ClusterConfig(
        dtype="float32", port=0, metrics_port=0, redis_prefix=f"pdserve-sweep-{name}-{time.time_ns()}",
        start_timeout_s=900.0,
        engine_args=("--num-kv-blocks", str(num_kv_blocks), "--torch-threads", str(threads)), **LAYOUTS[name],
    ))


def gateway_routes(cluster: LocalCluster) -> dict[str, float]:
    """The gateway's prefill-route counters so far, as ``{"route/reason": count}`` (its ``/metrics``)."""
    port = cluster.metrics_ports["gateway"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    routes = {}
    for labels, value in ROUTE_LINE.findall(body):
        named = dict(LABEL.findall(labels))  # prometheus_client writes labels in sorted order
        routes[f"{named['route']}/{named['reason']}"] = float(value)
    return routes


def _wait_serving(endpoint: str, timeout_s: float = 120.0) -> None:
    """Until the gateway describes the model: on a loaded machine its workers' load polls can time out for a while."""
    import grpc

    from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while True:
            try:
                stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=5)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)


def _bench(endpoint: str, out: Path, rate: float, num_prompts: int, seed: int, warmup: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "pdserve", "bench", "--target", endpoint, "--result-json", str(out),
               "--ignore-eos", "--disable-tqdm", "--goodput", *SLOS, *WORKLOAD, "--num-prompts", str(num_prompts),
               "--request-rate", str(rate), "--seed", str(seed), "--warmup", str(warmup)]
    _wait_serving(endpoint)
    with open(out.with_suffix(".log"), "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if not out.exists():
        raise RuntimeError(f"pdserve bench exited with status {done.returncode}; see {out.with_suffix('.log')}")
    # A failed request makes bench exit 1; the run is still reported (its failures are in the metrics).
    return json.loads(out.read_text())["runs"][0]["metrics"]


def _row(rate: float, name: str, metrics: dict[str, Any], routes: dict[str, float] | None) -> dict[str, Any]:
    return {
        "rate": rate, "layout": name, "goodput": metrics["goodput"], "output_throughput": metrics["output_throughput"],
        # Goodput is good requests over the run's own length: where every layout's requests all meet the SLOs,
        # the layouts differ only by when their last request ended, which this count shows.
        "good_requests": metrics["good_requests"], "requests": metrics["completed"] + metrics["failed"],
        "ttft_p50": metrics["ttft"]["median_ms"], "ttft_p99": metrics["ttft"]["p99_ms"],
        "tpot_p50": metrics["tpot"]["median_ms"], "tpot_p99": metrics["tpot"]["p99_ms"],
        "itl_p50": metrics["itl"]["median_ms"], "routes": routes,
    }


def verdict(rows: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """The three targets at one rate, from the three layouts' rows."""
    auto, colocated, disaggregated = rows["auto"], rows["colocated"], rows["disaggregated"]
    return {
        "goodput": auto["goodput"] >= max(colocated["goodput"], disaggregated["goodput"]),
        "ttft_p50": auto["ttft_p50"] <= 1.1 * colocated["ttft_p50"],
        "tpot_p99": auto["tpot_p99"] <= 1.1 * disaggregated["tpot_p99"],
    }


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| rate (req/s) | layout | goodput (req/s) | within the SLOs | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | "
             "TPOT p99 | auto's routes |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        routes = ", ".join(f"{k} {v:g}" for k, v in sorted(row["routes"].items())) if row["routes"] else ""
        lines.append(f"| {row['rate']:g} | {row['layout']} | {row['goodput']:.4f} | "
                     f"{row['good_requests']}/{row['requests']} | {row['output_throughput']:.1f} | "
                     f"{row['ttft_p50']:,.0f} | {row['ttft_p99']:,.0f} | {row['tpot_p50']:,.0f} | "
                     f"{row['tpot_p99']:,.0f} | {routes} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="0.25,0.5,1", help="request rates (req/s), comma-separated")
    parser.add_argument("--num-prompts", type=int, default=12, help="requests per run")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests per run (fresh prompts)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--num-kv-blocks", type=int, default=512, help="KV pool of every worker (16 tokens a block)")
    parser.add_argument("--all-at-once", action="store_true",
                        help="start the three clusters together and interleave their runs per rate "
                        "(needs memory for five workers; default: one cluster after the other)")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/disaggregation_sweep"))
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[float, dict[str, dict[str, Any]]] = {rate: {} for rate in rates}

    def drive(name: str, cluster: LocalCluster, index: int, rate: float) -> None:
        before = gateway_routes(cluster) if name == "auto" else None
        metrics = _bench(cluster.endpoint, args.out_dir / f"{name}_{rate:g}.json", rate, args.num_prompts,
                         seed=300 + index, warmup=args.warmup)
        routes = None
        if before is not None:
            after = gateway_routes(cluster)
            routes = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
        runs[rate][name] = _row(rate, name, metrics, routes)
        print(json.dumps(runs[rate][name]), flush=True)

    if args.all_at_once:
        # Every rate's three runs back to back: the fairest comparison on a machine whose load drifts.
        with ExitStack() as stack:
            clusters = {name: stack.enter_context(_cluster(name, args.threads, args.num_kv_blocks)) for name in LAYOUTS}
            for index, rate in enumerate(rates):
                for name, cluster in clusters.items():
                    drive(name, cluster, index, rate)
    else:
        for name in LAYOUTS:
            with _cluster(name, args.threads, args.num_kv_blocks) as cluster:
                for index, rate in enumerate(rates):
                    drive(name, cluster, index, rate)
    rows = [runs[rate][name] for rate in rates for name in LAYOUTS]
    verdicts = {rate: verdict(runs[rate]) for rate in rates}
    summary = {"slos": SLOS, "workload": WORKLOAD, "threads": args.threads, "rows": rows,
               "verdicts": {str(k): v for k, v in verdicts.items()}}
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(_table(rows))
    for rate, result in verdicts.items():
        print(f"rate {rate:g}: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
