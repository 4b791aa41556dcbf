"""Speculative decoding served through ``pdserve up``: ITL, TPOT, TTFT at a low request rate, gRPC and OpenAI HTTP.

One ``pdserve up`` cluster per setting (one prefill and one decode worker, the
default model in float32, loopback, ephemeral ports), all started at once by
this script (by PID, stopped in ``finally``), then driven by ``pdserve bench``'s
runner over the public gRPC API and the OpenAI HTTP API (``--backend http``) in
turn, runs of the settings alternating so that machine noise falls on all of
them alike. Workloads: the grounded and chat prompts of
``benchmarks/spec_decode.py`` through the model's chat template, greedy. Settings:

* ``plain``: no speculation;
* ``ngram``: ``{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}``;
* ``ngram-adaptive``: the same with ``"adaptive": true`` (each request's proposal
  length from its acceptance and the measured step costs);
* ``draft``: the target in bf16 with INT4 weights as its own draft, k=3; its
  prompt KV recomputed on the decode worker (``up --draft-prompt-kv recompute``);
* ``draft-prefill``: the same draft, its prompt KV built on the prefill worker
  beside the target's and handed over (``up --draft-prompt-kv prefill``).

Per (setting, API, workload): TTFT, the first-to-second-token gap (where a
recomputed draft prefill lands), ITL p50, TPOT, acceptance (gRPC usage), and
the KV bytes the decode worker received per request (its Prometheus counter).

    OMP_NUM_THREADS=1 python -m benchmarks.spec_served [--max-tokens 96] [--request-rate 0.25] [--passes 2]
        [--settings plain,ngram,ngram-adaptive,draft,draft-prefill] [--apis grpc,http] [--more-chat] [--json out.json]

Memory: every worker of the default model takes about 1.7 GB resident (2 GB with the
draft), so all four settings at once need about 15 GB; on a smaller or shared machine
run them in groups (``--settings draft,draft-prefill``, then ``--settings plain,ngram``).

By default each prompt is sent alone to every cluster in turn (concurrency 1: the
lowest request rate, and machine noise falls on every setting alike);
``--request-rate R`` sends each workload's prompts at R requests/s instead.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.spec_decode import CHAT, GROUNDED, MORE_CHAT

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
DRAFT = {"method": "draft_model", "model": "default", "num_speculative_tokens": 3, "dtype": "bfloat16",
         "quantization": "int4"}
SETTINGS: dict[str, list[str]] = {
    "plain": [],
    "ngram": ["--speculative-config", json.dumps(NGRAM)],
    "ngram-adaptive": ["--speculative-config", json.dumps({**NGRAM, "adaptive": True})],
    "draft": ["--speculative-config", json.dumps(DRAFT), "--draft-prompt-kv", "recompute"],
    "draft-prefill": ["--speculative-config", json.dumps(DRAFT), "--draft-prompt-kv", "prefill"],
}
# Generous: on a machine shared with other sessions (load average 30-60 on 2 cores) importing torch
# and loading the model took more than up's default 300 s; a slow health answer must not restart a worker.
START_TIMEOUT_S = 1500.0
SUPERVISION = ["--start-timeout", "1200", "--unhealthy-after", "600"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Cluster:
    """One ``pdserve up`` process (which starts and stops its workers and gateway) and where it serves."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_target: str = ""
    http_target: str = ""
    metrics: dict[str, str] = field(default_factory=dict)  # process name -> /metrics URL

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()  # up's own children die with their parent's SIGTERM handler; this is the last resort
                self.process.wait()


def start_cluster(name: str, extra: list[str], redis_prefix: str, num_kv_blocks: int, workdir: Path) -> Cluster:
    grpc_port, http_port = _free_port(), _free_port()
    log_path = workdir / f"up-{name}.log"
    command = [sys.executable, "-m", "pdserve", "up", "--no-http", "--dtype", "float32", "--port", str(grpc_port),
               "--http-port", str(http_port), "--num-kv-blocks", str(num_kv_blocks), "--redis-prefix", redis_prefix,
               "--metrics-port", "0", *SUPERVISION, *extra]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    cluster = Cluster(name, process, log_path, http_target=f"127.0.0.1:{http_port}")
    return cluster


def wait_serving(cluster: Cluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = cluster.log_path.read_text(errors="replace")
        match = re.search(r"pdserve is serving .* on (\S+) \(", text)
        if match:
            cluster.grpc_target = match.group(1)
            cluster.metrics = dict(re.findall(r"(\S+) (http://\S+/metrics)", text.split("metrics:", 1)[-1]))
            return
        if cluster.process.poll() is not None:
            raise RuntimeError(f"pdserve up for {cluster.name} exited:\n{text[-3000:]}")
        time.sleep(2)
    raise RuntimeError(f"pdserve up for {cluster.name} did not serve within {START_TIMEOUT_S} s")


def chat_datasets(max_tokens: int, workdir: Path, prompts_of: dict[str, tuple[str, ...]]) -> dict[str, Path]:
    """Each workload's prompts through the default model's chat template, as ``pdserve bench`` files."""
    from transformers import AutoTokenizer

    from pdserve.engine.model_loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    paths = {}
    for workload, prompts in prompts_of.items():
        path = workdir / f"{workload}.jsonl"
        lines = []
        for prompt in prompts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            lines.append(json.dumps({"prompt_token_ids": list(ids), "output_len": max_tokens}))
        path.write_text("\n".join(lines) + "\n")
        paths[workload] = path
    return paths


def scrape(url: str) -> dict[str, float]:
    """Counters of a /metrics page, summed over labels."""
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def run_bench(api: str, target: str, dataset: Path, num_prompts: int, rate: float, seed: int,
              result: Path) -> dict[str, Any]:
    from pdserve.bench.cli import bench
    from pdserve.bench.config import BenchConfig
    from pdserve.bench.runner import SamplingConfig
    from pdserve.bench.workload import WorkloadConfig

    config = BenchConfig(
        workload=WorkloadConfig(kind="file", dataset=dataset, num_prompts=num_prompts, seed=seed),
        backend=api, target=target, request_rates=(rate,),
        sampling=SamplingConfig(temperature=0.0, ignore_eos=False, timeout_s=600.0),
        result_json=result, show_progress=False,
    )
    out = io.StringIO()
    result.unlink(missing_ok=True)
    asyncio.run(bench(config, out=out))
    if not result.exists():  # it could not even describe the model
        raise RuntimeError(f"pdserve bench --backend {api} against {target} failed:\n{out.getvalue()}")
    return json.loads(result.read_text())  # failed requests are in it, counted by status


def measure(cluster: Cluster, api: str, workload: str, dataset: Path, index: int | None, rate: float | None,
            number: int, workdir: Path) -> dict[str, Any]:
    """One ``pdserve bench`` run against ``cluster``: prompt ``index`` alone, or every prompt at ``rate``."""
    target = cluster.grpc_target if api == "grpc" else cluster.http_target
    if index is not None:
        lines = dataset.read_text().splitlines()
        dataset = workdir / f"{workload}-{index}.jsonl"
        dataset.write_text(lines[index] + "\n")
    decode_metrics = cluster.metrics.get("decode-0")
    before = scrape(decode_metrics) if decode_metrics else {}
    path = workdir / f"{cluster.name}-{api}-{workload}-{index}-{number}.json"
    num_prompts = 1 if index is not None else len(dataset.read_text().splitlines())
    document = run_bench(api, target, dataset, num_prompts, rate or 1000.0, number, path)
    after = scrape(decode_metrics) if decode_metrics else {}
    summary = summarize(document)
    received = after.get("pdserve_kv_transfer_bytes_total", 0.0) - before.get("pdserve_kv_transfer_bytes_total", 0.0)
    summary["kv_bytes_per_request"] = received / max(summary["completed"], 1)
    summary.update(setting=cluster.name, api=api, workload=workload, prompt=index, number=number,
                   load=os.getloadavg()[0])
    print(json.dumps(summary), flush=True)
    return summary


def summarize(document: dict[str, Any]) -> dict[str, Any]:
    (run,) = document["runs"]
    metrics, requests = run["metrics"], run["requests"]
    gaps = [(r["chunk_times"][1] - r["chunk_times"][0]) * 1000 for r in requests if len(r["chunk_times"]) > 1]
    return {
        "ttft_median_ms": metrics["ttft"]["median_ms"],
        "first_gap_median_ms": statistics.median(gaps) if gaps else None,
        "itl_median_ms": metrics["itl"]["median_ms"],
        "tpot_median_ms": metrics["tpot"]["median_ms"],
        "tpot_mean_ms": metrics["tpot"]["mean_ms"],
        "e2el_median_ms": metrics["e2el"]["median_ms"],
        "output_tokens": metrics["total_output_tokens"],
        "acceptance": metrics.get("spec_decode_acceptance_rate"),
        "mean_accepted_length": metrics.get("spec_decode_mean_accepted_length"),
        "completed": metrics["completed"],
        "itls_ms": [(b - a) * 1000 for r in requests for a, b in zip(r["chunk_times"], r["chunk_times"][1:])],
        "errors": metrics["first_errors"],
    }


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM too stops the clusters in main's finally


def main(argv: list[str] | None = None) -> dict[str, Any]:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of " + ", ".join(SETTINGS))
    parser.add_argument("--apis", default="grpc,http", help="grpc, http or both")
    parser.add_argument("--workloads", default="grounded,chat")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--request-rate", type=float, default=None,
                        help="requests/s, Poisson, every prompt of a workload per run (default: one request at a "
                        "time, each prompt to every setting in turn)")
    parser.add_argument("--passes", type=int, default=1, help="runs per (setting, API, workload), order reversed "
                        "every other pass; medians pooled over passes")
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--more-chat", action="store_true", help="chat: the 4 prompts and 8 more (MORE_CHAT)")
    args = parser.parse_args(argv)
    names = args.settings.split(",")
    for name in names:
        if name not in SETTINGS:
            parser.error(f"unknown setting {name!r}; choose from {', '.join(SETTINGS)}")
    apis, workloads = args.apis.split(","), args.workloads.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="spec-served-"))
    prompts_of = {"grounded": GROUNDED, "chat": CHAT + (MORE_CHAT if args.more_chat else ())}
    datasets = chat_datasets(args.max_tokens, workdir, prompts_of)
    redis_prefix = f"pdserve-spec-served-{os.getpid()}"
    print(f"load average at start: {os.getloadavg()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
          flush=True)
    clusters: dict[str, Cluster] = {}
    results: dict[str, Any] = {"runs": [], "load_average": [os.getloadavg()]}
    try:
        for name in names:  # one at a time: starting them together only slows each start down
            # Its own Redis namespace: clusters sharing one would discover each other's workers.
            cluster = clusters[name] = start_cluster(name, SETTINGS[name], f"{redis_prefix}-{name}",
                                                     args.num_kv_blocks, workdir)
            wait_serving(cluster)
            print(f"{cluster.name}: gRPC {cluster.grpc_target}, HTTP {cluster.http_target}", flush=True)
        # One warm-up request per cluster and API (first forwards allocate), of token ids no prompt shares.
        warmup = workdir / "warmup.jsonl"
        warmup.write_text(json.dumps({"prompt_token_ids": list(range(1000, 1064)), "output_len": 16}) + "\n")
        for cluster in clusters.values():
            for api in apis:
                target = cluster.grpc_target if api == "grpc" else cluster.http_target
                run_bench(api, target, warmup, 1, 1000.0, 99, workdir / "warmup.json")
        for number in range(args.passes):
            for api in apis:
                for workload in workloads:
                    if args.request_rate is None:
                        # One request at a time, each prompt sent to every cluster in turn (order rotating):
                        # the lowest load there is, and noise from other processes falls on every setting alike.
                        for index in range(len(prompts_of[workload])):
                            shift = (index + number) % len(names)
                            for name in names[shift:] + names[:shift]:
                                results["runs"].append(measure(clusters[name], api, workload, datasets[workload],
                                                               index, None, number, workdir))
                    else:
                        order = names if number % 2 == 0 else names[::-1]
                        for name in order:
                            results["runs"].append(measure(clusters[name], api, workload, datasets[workload],
                                                           None, args.request_rate, number, workdir))
    finally:
        for cluster in clusters.values():
            cluster.stop()
        for name in clusters:
            _delete_redis_keys(f"{redis_prefix}-{name}")
        shutil.rmtree(workdir, ignore_errors=True)
    results["load_average"].append(os.getloadavg())
    results["table"] = table(results["runs"], names, apis, workloads)
    print(results["table"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


def table(runs: list[dict[str, Any]], names: list[str], apis: list[str], workloads: list[str]) -> str:
    """Per (API, workload, setting): medians over runs (over prompts when one at a time), ITL p50 over
    every gap pooled, and plain's TPOT over the setting's (above 1: faster)."""
    rows = ["| API | workload | setting | TTFT p50 ms | 1st→2nd token ms | ITL p50 ms | TPOT p50 ms | "
            "x plain TPOT | acceptance | KV bytes/request |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for api in apis:
        for workload in workloads:
            plain_tpot = None
            for name in names:
                mine = [r for r in runs if (r["api"], r["workload"], r["setting"]) == (api, workload, name)]
                if not mine:
                    continue

                def med(key: str, mine: list[dict[str, Any]] = mine) -> float | None:
                    values = [r[key] for r in mine if r[key] is not None]
                    return statistics.median(values) if values else None

                itls = [gap for r in mine for gap in r["itls_ms"]]
                itl = statistics.median(itls) if itls else float("nan")
                tpot = med("tpot_median_ms")
                if name == "plain":
                    plain_tpot = tpot
                ratio = f"{plain_tpot / tpot:.2f}x" if plain_tpot and tpot else "–"
                acceptance = med("acceptance")
                rows.append(
                    f"| {api} | {workload} | {name} | {med('ttft_median_ms'):.0f} | {med('first_gap_median_ms'):.0f} | "
                    f"{itl:.0f} | {tpot:.1f} | {ratio} | "
                    f"{'–' if acceptance is None else f'{acceptance:.2f}'} | {med('kv_bytes_per_request'):,.0f} |"
                )
    return "\n".join(rows)


def _delete_redis_keys(prefix: str) -> None:
    """Only this benchmark's keys (the Redis server is shared)."""
    try:
        import redis
    except ImportError:
        return
    try:
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    except Exception as error:  # noqa: BLE001 - cleanup must not hide the results
        print(f"could not delete Redis keys under {prefix}: {error}", file=sys.stderr)


if __name__ == "__main__":
    main()
