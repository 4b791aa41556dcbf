"""The disaggregated cluster against the in-process engine, on the offline benchmark's workload.

    python -m benchmarks.cluster_throughput [--num-prompts 32] [--output-len 64] [--transport grpc]
                                            [--probes 4] [--probe-len 1000] [--prefill-niceness 0]
                                            [--openmp-spin adaptive]
                                            [--disaggregation always] [--repeats 1] [--step-trace DIR]
                                            [--prefill-args FLAGS] [--decode-args FLAGS] [--json out.json]

Side by side in one run: pdserve's ``LLM.generate`` in this process, then a
local cluster (``pdserve up``: 1 prefill + 1 decode worker and the gateway as
processes, KV over the chosen transport on loopback) driven with every request
at once over gRPC. Reports output tokens/s and their ratio, TTFT p50/p99, the
time from first to second token, and the decode worker's own time to have the
KV (``--kv-push``, the default: taking what the prefill worker pushed while it
ran; ``--no-kv-push``: fetching it after the first token). Greedy, float32, EOS ignored; the cluster's tokens are compared
with the in-process ones. Per round it also gives the CPU seconds each side used: the
in-process engine's, and each cluster process's over the burst.

The handoff under this load: a workload like it (other prompts, so
nothing is cached) is then sent, and ``--probes`` requests of ``--probe-len`` random tokens go in while it runs,
one every ``--probe-interval-s``. For them: the first-to-second token gap, the
ITL (mean gap between later tokens), their ratio, and the handoff's cost as the
client sees it (gap - ITL: what the second token waits for beyond a decode
step), next to what the transport alone takes to move the same bytes between
two idle processes (``benchmarks.kv_transfer``, measured before any worker starts);
and the five gaps after the second token (the decode steps right after the
handoff, beside whatever the prefill worker computes next), per probe in the JSON.

``--disaggregation`` is the gateway's: ``always`` (the default here) sends every
prompt through the prefill worker and a KV handoff, the path this benchmark
measures; ``auto`` (``pdserve up``'s default) lets the gateway prefill a prompt
on the decode worker where that is cheaper, and the report counts its routes;
``never`` prefills every prompt on the decode worker: the served path without a
handoff, which tells what the serving itself costs against the in-process engine.

``--prefill-args`` and ``--decode-args``: more flags for one worker, as one
string each (``--prefill-args '--max-num-batched-tokens 8192'``; a single
flag with no space in it needs the ``=`` form, ``--decode-args=--niceness=3``,
or argparse takes it for an option of its own), so that a variant of the
cluster is measured by this command rather than by a wrapper around it; the
report and the JSON name them.

``--repeats N``: the in-process engine and the cluster run N times each,
alternated (the in-process run first in rounds 1, 3, ..., the cluster's first in
rounds 2, 4, ...), each round on prompts of its own so that nothing is cached; the cluster
stays up between rounds. On a shared machine whose speed drifts by tens of
percent within minutes, one pair says little: the report gives every round's
ratio and their median.

``--step-trace DIR``: every engine (the in-process one and each worker's) writes
its steps to DIR (``PDSERVE_STEP_TRACE_DIR``), and the report ends with round 1's
steps of each, phase by phase (``benchmarks.step_trace``): which steps the
cluster's engines ran, at which batch sizes, and what each cost, against the
in-process engine's. With probes it also splits each probe's first-to-second
token gap over the decode worker's steps (``step_trace.split_gap``; the
probes' token times are taken on ``time.monotonic``, the traces' clock): the
wait for the decode step in flight when the first token arrived (a request
joins the batch only between steps), other waits before the step that
computes the second token (the KV landing, the start's trip, a hold), that
step, and the relay to the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import grpc

from benchmarks import kv_transfer, step_trace
from benchmarks.disaggregation_sweep import gateway_routes
from benchmarks.pdserve_runner import PdserveSettings, run_pdserve
from benchmarks.workload import make_warmup_workload, make_workload
from pdserve.engine.step_trace import ENV as STEP_TRACE_ENV
from pdserve.launcher import ClusterConfig, LocalCluster
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.server import channel_options

VOCAB_SIZE = 49152


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time process ``pid`` has used, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        # After the command name's closing parenthesis: state is field 3, utime 14, stime 15.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cluster_cpu(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds used so far by each running process of ``cluster``, and by this one (``client``)."""
    used = {name: cpu_seconds(process.pid) for name, process in cluster.processes if process.poll() is None}
    used["client"] = time.process_time()
    return used


async def _one(stub: generation_pb2_grpc.GenerationStub, prompt: list[int], output_len: int) -> dict:
    params = generation_pb2.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    stamps: list[float] = []
    tokens: list[int] = []
    async for response in stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params), timeout=600):
        now = time.perf_counter()
        stamps.extend([now] * len(response.token_ids))
        tokens.extend(response.token_ids)
    return {"ttft": stamps[0] - started, "second": stamps[1] - stamps[0] if len(stamps) > 1 else 0.0, "tokens": tokens}


async def _drive(endpoint: str, prompts: list[list[int]], output_len: int) -> tuple[list[dict], float]:
    async with grpc.aio.insecure_channel(endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        started = time.perf_counter()
        results = await asyncio.gather(*(_one(stub, p, output_len) for p in prompts))
        return results, time.perf_counter() - started


async def _probe(stub: generation_pb2_grpc.GenerationStub, prompt: list[int], output_len: int,
                 delay_s: float) -> dict[str, float]:
    await asyncio.sleep(delay_s)
    params = generation_pb2.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # One per token: when the response carrying it arrived, on the clock the engines' step traces use.
    stamps: list[float] = []
    async for response in stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params),
                                        timeout=600):
        stamps.extend([time.monotonic()] * len(response.token_ids))
    gap = stamps[1] - stamps[0]
    # Later tokens may arrive several to a response: the mean over the stream, not per pair.
    itl = (stamps[-1] - stamps[1]) / (len(stamps) - 2)
    # The first gaps after the second token: the decode steps right after the handoff, which run beside
    # whatever the prefill worker computes next (the mean ITL is mostly later, quieter steps).
    early = [b - a for a, b in zip(stamps[1:6], stamps[2:7])]
    return {"gap": gap, "itl": itl, "ratio": gap / itl, "handoff": gap - itl, "early_gaps": early,
            "first_at": stamps[0], "second_at": stamps[1]}


async def _drive_with_probes(endpoint: str, prompts: list[list[int]], output_len: int, probes: list[list[int]],
                             probe_interval_s: float) -> list[dict[str, float]]:
    """The workload again, all at once, and the probes sent into it one by one; the probes' timings."""
    async with grpc.aio.insecure_channel(endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        load = asyncio.gather(*(_one(stub, p, output_len) for p in prompts))
        timed = asyncio.gather(*(_probe(stub, probe, output_len, probe_interval_s * (i + 1))
                                 for i, probe in enumerate(probes)))
        _, probe_results = await asyncio.gather(load, timed)
        return probe_results


def _transport_unloaded(transport: str, tokens: int) -> dict[str, float]:
    """What ``transport`` alone takes to move the KV of ``tokens`` tokens of the default model, two idle processes."""
    args = kv_transfer.parse_args(["--tokens", str(tokens), "--transports", transport])
    return asyncio.run(kv_transfer.measure(args))[transport]


async def _decode_report(address: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        return await worker_pb2_grpc.DecodeWorkerStub(channel).Load(worker_pb2.LoadRequest(), timeout=10)


def round_seed(seed: int, index: int) -> int:
    """The workload seed of round ``index``: the first round's is ``seed`` itself (a one-round run is the
    benchmark it always was); later rounds' stay clear of ``seed + 2``, the probes' workload."""
    return seed if index == 0 else seed + 1000 * index


def round_order(index: int) -> tuple[str, str]:
    """Which side runs first in round ``index``: in-process in even rounds, the cluster in odd ones, so that a
    machine that speeds up or slows down through the run favours neither."""
    return ("in_process", "cluster") if index % 2 == 0 else ("cluster", "in_process")


def cpu_report(round_rates: list[dict], cpus: int) -> str:
    """Where the CPU went in each round: the in-process engine, then each process of the cluster."""
    lines = [f"CPU seconds per round ({cpus} CPUs; the share is of CPUs x wall time):"]
    for i, r in enumerate(round_rates):
        cluster = r["cluster_cpu_s"]
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in cluster.items())
        total = sum(cluster.values())
        lines.append(
            f"  round {i + 1}: in-process {r['in_process_cpu_s']:.1f} "
            f"({r['in_process_cpu_s'] / (cpus * r['in_process_wall_s']):.0%}); cluster {total:.1f} "
            f"({total / (cpus * r['cluster_wall_s']):.0%}): {parts}"
        )
    return "\n".join(lines)


def step_report(directory: Path, first_round: dict, pids: dict[str, int]) -> str:
    """Round 1's engine steps: the in-process engine's over its timed ``generate``, each cluster engine's over the burst."""
    traces = step_trace.load(directory)
    lines = ["round 1's engine steps (seconds from the start of each side's run):"]
    local = first_round["local"].details
    # In-process first, then the cluster's processes in start order (file names sort by pid as text).
    prefixes = [f"steps-{pid}-" for pid in (os.getpid(), *pids.values())]

    def rank(name: str) -> int:
        return next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), len(prefixes))

    for name in sorted(traces, key=rank):
        steps = traces[name]
        if name.startswith(f"steps-{os.getpid()}-"):
            since, until = local["started_monotonic"], local["ended_monotonic"]
            label = "in-process"
        else:
            since, until = first_round["cluster_window"]
            label = next((n for n, pid in pids.items() if name.startswith(f"steps-{pid}-")), name)
        shown = step_trace.window(steps, since, until)
        if shown:  # the in-process engines of other rounds have files of their own
            lines.extend(step_trace.describe(label, shown, since))
    return "\n".join(lines)


def probe_gap_splits(directory: Path, decode_pid: int, probe_results: list[dict]) -> list[step_trace.GapSplit | None]:
    """Each probe's first-to-second token gap split over the decode worker's steps (``step_trace.split_gap``)."""
    steps = sorted((s for name, trace in step_trace.load(directory).items() if name.startswith(f"steps-{decode_pid}-")
                    for s in trace), key=lambda s: s.started)
    return [step_trace.split_gap(steps, r["first_at"], r["second_at"]) for r in probe_results]


def gap_split_report(splits: list[step_trace.GapSplit | None]) -> str:
    """The p50 of each part of the probes' gaps, as one line."""
    known = [s for s in splits if s is not None]
    if not known:
        return "the probes' gaps: no decode step of the decode worker's trace ended before a second token"
    parts = {name: statistics.median(getattr(s, field) for s in known) * 1000 for name, field in (
        ("waiting for the decode step in flight", "in_flight_s"), ("other waits (landing, start, hold)", "other_wait_s"),
        ("its own first decode step", "own_step_s"), ("relay", "relay_s"))}
    return (f"the probes' gaps over the decode worker's steps ({len(known)} of {len(splits)}), p50s: "
            + ", ".join(f"{name} {ms:.0f} ms" for name, ms in parts.items()))


def cluster_config(args: argparse.Namespace, extra_env: dict[str, str]) -> ClusterConfig:
    """The cluster this benchmark starts: 1P+1D in float32, with the workers' flags the command line gives."""
    niceness = ("--niceness", str(args.prefill_niceness)) if args.prefill_niceness else ()
    return ClusterConfig(
        dtype="float32", port=0, kv_transport=args.transport, extra_env=extra_env,
        engine_args=("--num-kv-blocks", str(args.num_kv_blocks), "--openmp-spin", args.openmp_spin),
        redis_prefix=f"pdserve-bench-{time.time_ns()}", kv_push=args.kv_push, metrics_port=0,
        prefill_args=(*niceness, *args.prefill_args), decode_args=tuple(args.decode_args),
        disaggregation=args.disaggregation,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``sys.argv`` without ``argv``); exits with status 2 on a bad one, as argparse does."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", default="grpc", choices=["grpc", "shm", "torch_dist"])
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--kv-push", action=argparse.BooleanOptionalAction, default=True,
                        help="the gateway's --kv-push: KV pushed while the prefill runs (default), else pulled")
    parser.add_argument("--probes", type=int, default=4,
                        help="requests of --probe-len tokens sent into a second run of the workload (0: none)")
    parser.add_argument("--probe-len", type=int, default=1000)
    parser.add_argument("--probe-interval-s", type=float, default=1.0)
    parser.add_argument("--prefill-niceness", type=int, default=0,
                        help="`pdserve up --prefill-niceness`: the prefill worker yields the cores to the decode worker")
    parser.add_argument("--openmp-spin", default="adaptive", choices=["adaptive", "libgomp"],
                        help="the workers' --openmp-spin (libgomp: `pdserve up` then starts them with "
                        "OMP_WAIT_POLICY=PASSIVE, as before the governor)")
    parser.add_argument("--disaggregation", default="always", choices=["always", "auto", "never"],
                        help="the gateway's: always (every prompt handed off, the default here), auto, or never "
                             "(every prompt prefilled on the decode worker: the served path without a handoff)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of in-process and cluster runs, alternated, each on prompts of its own")
    parser.add_argument("--prefill-args", type=shlex.split, default=[], metavar="FLAGS",
                        help="more flags for the prefill worker, one string (e.g. '--max-num-batched-tokens 8192'): "
                             "a variant measured by this command rather than by a wrapper around it")
    parser.add_argument("--decode-args", type=shlex.split, default=[], metavar="FLAGS",
                        help="more flags for the decode worker, one string (e.g. '--niceness 5')")
    parser.add_argument("--step-trace", type=Path, default=None, metavar="DIR",
                        help="every engine writes its steps to DIR; the report ends with round 1's, phase by phase")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main() -> None:
    args = parse_args()
    workloads = [make_workload(args.num_prompts, args.min_len, args.max_len, args.output_len, VOCAB_SIZE,
                               round_seed(args.seed, i)) for i in range(args.repeats)]
    workload = workloads[0]
    warmup = make_warmup_workload(workload, VOCAB_SIZE, args.seed)
    settings = PdserveSettings(None, 16, args.num_kv_blocks, 256, 2048, True)
    rng = random.Random(args.seed + 1)
    probes = [[rng.randrange(VOCAB_SIZE) for _ in range(args.probe_len)] for _ in range(args.probes)]
    # Before any worker starts: the transport on an idle machine, for the probes' bytes.
    unloaded = _transport_unloaded(args.transport, args.probe_len) if probes else None

    trace_env = {}
    if args.step_trace is not None:
        trace_env = {STEP_TRACE_ENV: str(args.step_trace.resolve())}
        os.environ.update(trace_env)  # the in-process engines
    config = cluster_config(args, trace_env)
    rounds: list[dict] = []
    with LocalCluster(config) as cluster:
        asyncio.run(_drive(cluster.endpoint, warmup.prompt_lists(), warmup.output_len))
        before = asyncio.run(_decode_report(cluster.decode_addresses[0]))
        routes_before = gateway_routes(cluster)
        for i, round_workload in enumerate(workloads):
            timed_round: dict = {}
            for side in round_order(i):
                if side == "in_process":
                    timed_round["local"] = run_pdserve(settings, round_workload, warmup)
                else:
                    cpu_before = cluster_cpu(cluster)
                    started = time.monotonic()
                    timed_round["cluster"] = asyncio.run(
                        _drive(cluster.endpoint, round_workload.prompt_lists(), round_workload.output_len))
                    timed_round["cluster_window"] = (started, time.monotonic())
                    cpu_after = cluster_cpu(cluster)
                    timed_round["cpu"] = {name: cpu_after[name] - cpu_before[name]
                                          for name in cpu_after if name in cpu_before}
            rounds.append(timed_round)
        after = asyncio.run(_decode_report(cluster.decode_addresses[0]))
        routes = {k: v - routes_before.get(k, 0.0) for k, v in gateway_routes(cluster).items()}
        pids = {name: process.pid for name, process in cluster.processes}
        # A workload like the first, of other prompts: nothing of it is cached yet.
        second = make_workload(args.num_prompts, args.min_len, args.max_len, args.output_len, VOCAB_SIZE, args.seed + 2)
        probe_results = asyncio.run(_drive_with_probes(
            cluster.endpoint, second.prompt_lists(), second.output_len, probes, args.probe_interval_s
        )) if probes else []
    local = rounds[0]["local"]
    results, wall = rounds[0]["cluster"]
    round_rates = []
    identical = 0
    for i, timed_round in enumerate(rounds):
        round_results, round_wall = timed_round["cluster"]
        round_local = timed_round["local"]
        in_process_tps = round_local.num_output_tokens / round_local.wall_s
        round_tps = sum(len(r["tokens"]) for r in round_results) / round_wall
        round_rates.append({"in_process_tokens_per_s": in_process_tps, "cluster_tokens_per_s": round_tps,
                            "cluster_over_in_process": round_tps / in_process_tps, "first": round_order(i)[0],
                            "in_process_cpu_s": round_local.details["cpu_s"], "cluster_cpu_s": timed_round["cpu"],
                            "cluster_wall_s": round_wall, "in_process_wall_s": round_local.wall_s})
        identical += sum(tuple(r["tokens"]) == ref for r, ref in zip(round_results, round_local.token_ids))
    ratios = [r["cluster_over_in_process"] for r in round_rates]
    # The headline figures are the first round's: a one-round run reads as it always did.
    local_tps, cluster_tps = round_rates[0]["in_process_tokens_per_s"], round_rates[0]["cluster_tokens_per_s"]
    # Latencies over every round's requests.
    every = [r for timed_round in rounds for r in timed_round["cluster"][0]]
    ttft = [r["ttft"] for r in every]
    second = [r["second"] for r in every]
    # Handoffs counted over every round; the per-request means below hold for any number of rounds.
    transfers = after.kv_transfers - before.kv_transfers
    transfer_s = (after.kv_receive_seconds - before.kv_receive_seconds) / max(1, transfers)
    transfer_mb = (after.kv_bytes_received - before.kv_bytes_received) / max(1, transfers) / 2**20
    summary = {
        "workload": {"prompts": args.num_prompts, "prompt_tokens": workload.num_prompt_tokens, "output_len": args.output_len},
        "prefill_niceness": args.prefill_niceness,
        "prefill_args": args.prefill_args,
        "decode_args": args.decode_args,
        "openmp_spin": args.openmp_spin,
        "disaggregation": args.disaggregation,
        "routes": {k: v for k, v in routes.items() if v},
        "in_process": {"wall_s": local.wall_s, "output_tokens_per_s": local_tps},
        "cluster": {
            "transport": args.transport,
            "wall_s": wall,
            "output_tokens_per_s": cluster_tps,
            "ttft_p50_ms": statistics.median(ttft) * 1000,
            "ttft_p99_ms": _percentile(ttft, 0.99) * 1000,
            "first_to_second_token_p50_ms": statistics.median(second) * 1000,
            "kv_transfer_mean_ms": transfer_s * 1000,
            "kv_transfer_mean_mib": transfer_mb,
            "kv_transfers": transfers,
            "kv_pushes": after.kv_pushes - before.kv_pushes,
        },
        "cluster_over_in_process": statistics.median(ratios),
        "rounds": round_rates,
        "identical_outputs": f"{identical}/{len(every)}",
    }
    splits = (probe_gap_splits(args.step_trace, pids["decode-0"], probe_results)
              if probe_results and args.step_trace is not None else [])
    if probe_results:
        assert unloaded is not None
        summary["handoff_under_load"] = {
            "probes": len(probe_results),
            "prompt_tokens": args.probe_len,
            "gap_p50_ms": statistics.median(r["gap"] for r in probe_results) * 1000,
            "itl_p50_ms": statistics.median(r["itl"] for r in probe_results) * 1000,
            "gap_over_itl_p50": statistics.median(r["ratio"] for r in probe_results),
            "handoff_p50_ms": statistics.median(r["handoff"] for r in probe_results) * 1000,
            "early_itl_p50_ms": statistics.median(g for r in probe_results for g in r["early_gaps"]) * 1000,
            "transport_unloaded_ms": unloaded["seconds"] * 1000,
            "transport_unloaded_mib": unloaded["bytes"] / 2**20,
            # Each probe's own figures, to pool over runs: the gap, its mean ITL, and its next five gaps.
            "per_probe_ms": [{"gap": r["gap"] * 1000, "itl": r["itl"] * 1000,
                              "early_gaps": [g * 1000 for g in r["early_gaps"]]} for r in probe_results],
        }
        if splits:
            # With --step-trace: each probe's gap over the decode worker's steps (None where no step matched).
            summary["handoff_under_load"]["gap_split_ms"] = [
                None if split is None else {k: v * 1000 for k, v in asdict(split).items()} for split in splits]
    c = summary["cluster"]
    print(f"in-process LLM.generate: {local.wall_s:.2f} s, {local_tps:.1f} output tokens/s")
    extra = "".join(f", {role} worker {shlex.join(flags)}" for role, flags in
                    (("prefill", args.prefill_args), ("decode", args.decode_args)) if flags)
    print(f"cluster 1P+1D ({args.transport}, prefill niceness {args.prefill_niceness}, openmp spin "
          f"{args.openmp_spin}, disaggregation {args.disaggregation}{extra}): {wall:.2f} s, "
          f"{cluster_tps:.1f} output tokens/s -> {cluster_tps / local_tps:.0%} of in-process")
    if len(rounds) > 1:
        for i, r in enumerate(summary["rounds"]):
            print(f"  round {i + 1} ({r['first'].replace('_', '-')} first): in-process {r['in_process_tokens_per_s']:.1f}, "
                  f"cluster {r['cluster_tokens_per_s']:.1f} output tokens/s -> {r['cluster_over_in_process']:.0%}")
        print(f"cluster / in-process over {len(rounds)} rounds: median {statistics.median(ratios):.0%} "
              f"(min {min(ratios):.0%}, max {max(ratios):.0%})")
    print(cpu_report(round_rates, len(os.sched_getaffinity(0))))
    print("the gateway's routes: " + ", ".join(f"{k} {v:g}" for k, v in sorted(summary["routes"].items())))
    print(f"TTFT p50 {c['ttft_p50_ms']:.0f} ms, p99 {c['ttft_p99_ms']:.0f} ms; first->second token p50 "
          f"{c['first_to_second_token_p50_ms']:.0f} ms; KV transfer {c['kv_transfer_mean_ms']:.1f} ms per request "
          f"({c['kv_transfer_mean_mib']:.1f} MiB, {transfers} transfers, {c['kv_pushes']} of them pushed)")
    print(f"outputs identical to in-process: {summary['identical_outputs']}")
    if probe_results:
        h = summary["handoff_under_load"]
        print(f"under that load, {h['probes']} probes of {args.probe_len} tokens: gap p50 {h['gap_p50_ms']:.0f} ms, "
              f"ITL p50 {h['itl_p50_ms']:.0f} ms, gap/ITL p50 {h['gap_over_itl_p50']:.2f}x; handoff (gap - ITL) p50 "
              f"{h['handoff_p50_ms']:.0f} ms vs the {args.transport} transport unloaded "
              f"{h['transport_unloaded_ms']:.0f} ms for the same {h['transport_unloaded_mib']:.1f} MiB "
              f"({h['handoff_p50_ms'] / h['transport_unloaded_ms']:.2f}x); the five gaps after the second token p50 "
              f"{h['early_itl_p50_ms']:.0f} ms")
    if splits:
        print(gap_split_report(splits))
    if args.step_trace is not None:
        print(step_report(args.step_trace, rounds[0], pids))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)


if __name__ == "__main__":
    main()
