"""The disaggregated cluster against the in-process engine, on the offline benchmark's workload.

    python -m benchmarks.cluster_throughput [--num-prompts 32] [--output-len 64] [--transport grpc] [--json out.json]

Side by side in one run: pdserve's ``LLM.generate`` in this process, then a
local cluster (``pdserve up``: 1 prefill + 1 decode worker and the gateway as
processes, KV over the chosen transport on loopback) driven with every request
at once over gRPC. Reports output tokens/s and their ratio, TTFT p50/p99, the
time from first to second token, and the decode worker's own time to have the
KV (``--kv-push``, the default: taking what the prefill worker pushed while it
ran; ``--no-kv-push``: fetching it after the first token). Greedy, float32, EOS ignored; the cluster's tokens are compared
with the in-process ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import grpc

from benchmarks.pdserve_runner import PdserveSettings, run_pdserve
from benchmarks.workload import make_warmup_workload, make_workload
from pdserve.launcher import ClusterConfig, LocalCluster
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from service_common.server import channel_options

VOCAB_SIZE = 49152


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


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


async def _decode_report(address: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        return await worker_pb2_grpc.DecodeWorkerStub(channel).Load(worker_pb2.LoadRequest(), timeout=10)


def main() -> None:
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
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    workload = make_workload(args.num_prompts, args.min_len, args.max_len, args.output_len, VOCAB_SIZE, args.seed)
    warmup = make_warmup_workload(workload, VOCAB_SIZE, args.seed)
    settings = PdserveSettings(None, 16, args.num_kv_blocks, 256, 2048, True)
    local = run_pdserve(settings, workload, warmup)
    local_tps = local.num_output_tokens / local.wall_s

    config = ClusterConfig(
        dtype="float32", port=0, kv_transport=args.transport, engine_args=("--num-kv-blocks", str(args.num_kv_blocks)),
        redis_prefix=f"pdserve-bench-{time.time_ns()}", kv_push=args.kv_push,
        disaggregation="always",  # every prompt through a prefill worker and a KV handoff: the path measured here
    )
    with LocalCluster(config) as cluster:
        asyncio.run(_drive(cluster.endpoint, warmup.prompt_lists(), warmup.output_len))
        before = asyncio.run(_decode_report(cluster.decode_addresses[0]))
        results, wall = asyncio.run(_drive(cluster.endpoint, workload.prompt_lists(), workload.output_len))
        after = asyncio.run(_decode_report(cluster.decode_addresses[0]))
    output_tokens = sum(len(r["tokens"]) for r in results)
    cluster_tps = output_tokens / wall
    ttft = [r["ttft"] for r in results]
    second = [r["second"] for r in results]
    transfers = after.kv_transfers - before.kv_transfers
    transfer_s = (after.kv_receive_seconds - before.kv_receive_seconds) / max(1, transfers)
    transfer_mb = (after.kv_bytes_received - before.kv_bytes_received) / max(1, transfers) / 2**20
    same = sum(tuple(r["tokens"]) == ref for r, ref in zip(results, local.token_ids))
    summary = {
        "workload": {"prompts": args.num_prompts, "prompt_tokens": workload.num_prompt_tokens, "output_len": args.output_len},
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
        "cluster_over_in_process": cluster_tps / local_tps,
        "identical_outputs": f"{same}/{len(results)}",
    }
    c = summary["cluster"]
    print(f"in-process LLM.generate: {local.wall_s:.2f} s, {local_tps:.1f} output tokens/s")
    print(f"cluster 1P+1D ({args.transport}): {wall:.2f} s, {cluster_tps:.1f} output tokens/s "
          f"-> {summary['cluster_over_in_process']:.0%} of in-process")
    print(f"TTFT p50 {c['ttft_p50_ms']:.0f} ms, p99 {c['ttft_p99_ms']:.0f} ms; first->second token p50 "
          f"{c['first_to_second_token_p50_ms']:.0f} ms; KV transfer {c['kv_transfer_mean_ms']:.1f} ms per request "
          f"({c['kv_transfer_mean_mib']:.1f} MiB, {transfers} transfers, {c['kv_pushes']} of them pushed)")
    print(f"outputs identical to in-process: {summary['identical_outputs']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)


if __name__ == "__main__":
    main()
