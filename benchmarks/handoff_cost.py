"""What the KV handoff costs on an idle cluster: the first-to-second token gap against the inter-token latency.

    python -m benchmarks.handoff_cost [--prompt-lens 1000 2000] [--requests 6] [--output-len 32]
                                      [--transport grpc] [--modes push pull] [--json out.json]

Starts ``pdserve up`` (1 prefill + 1 decode worker and the gateway as processes,
the default model, float32) and a second gateway over the same two workers, one
per mode: ``push`` (the gateway's default ``--kv-push``: the prefill worker
pushes each layer's KV to the decode worker while it computes) and ``pull``
(``--no-kv-push``: the decode worker fetches the KV once the first token is
out). Requests alternate between the two gateways, one at a time, so nothing
queues and both modes see the same workers and the same machine:
whatever separates the first token (streamed as soon as the prefill worker
returns it) from the second is the handoff — the decode worker taking the
request, fetching the KV, landing it — plus one decode step and the relay.
Per prompt length: TTFT, the gap, the ITL (mean gap between later tokens, per
request), their ratio (the target is <= 1.5x), and the decode worker's own
time to have the KV per transfer (``LoadReport.kv_receive_seconds``: the fetch
when pulled, taking the pushed copy when pushed). Medians over the requests;
prompts are random and distinct, so no prefix is cached anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import grpc

from pdserve.launcher import ClusterConfig, LocalCluster
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.server import channel_options

VOCAB_SIZE = 49152


async def _one(stub: generation_pb2_grpc.GenerationStub, prompt: list[int], output_len: int) -> dict[str, float]:
    params = generation_pb2.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)
    started = time.perf_counter()
    stamps: list[float] = []  # one per token: when the response carrying it arrived
    async for response in stub.Generate(request, timeout=600):
        stamps.extend([time.perf_counter()] * len(response.token_ids))
    assert len(stamps) == output_len, f"{len(stamps)} tokens, expected {output_len}"
    return {
        "ttft": stamps[0] - started,
        "gap": stamps[1] - stamps[0],
        # Later tokens may arrive several to a response: the mean over the stream, not per pair.
        "itl": (stamps[-1] - stamps[1]) / (len(stamps) - 2),
    }


async def _decode_report(address: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        return await worker_pb2_grpc.DecodeWorkerStub(channel).Load(worker_pb2.LoadRequest(), timeout=10)


async def _measure(
    cluster: LocalCluster, endpoint: str, prompts: list[list[int]], output_len: int
) -> dict[str, float]:
    before = await _decode_report(cluster.decode_addresses[0])
    async with grpc.aio.insecure_channel(endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        results = [await _one(stub, prompt, output_len) for prompt in prompts]  # one at a time: idle cluster
    after = await _decode_report(cluster.decode_addresses[0])
    transfers = max(1, after.kv_transfers - before.kv_transfers)

    def p50(name: str) -> float:
        return statistics.median(r[name] for r in results) * 1000

    return {
        "requests": len(results),
        "ttft_p50_ms": p50("ttft"),
        "gap_p50_ms": p50("gap"),
        "itl_p50_ms": p50("itl"),
        "gap_over_itl": p50("gap") / p50("itl"),
        "kv_fetch_mean_ms": (after.kv_receive_seconds - before.kv_receive_seconds) / transfers * 1000,
        "kv_mib_per_request": (after.kv_bytes_received - before.kv_bytes_received) / transfers / 2**20,
        "pushed": after.kv_pushes - before.kv_pushes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1000, 2000])
    parser.add_argument("--requests", type=int, default=6, help="measured requests per prompt length")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--transport", default="grpc", choices=["grpc", "shm", "torch_dist"])
    parser.add_argument("--modes", nargs="+", default=["push", "pull"], choices=["push", "pull"],
                        help="one gateway per mode over the same workers, requests alternating between them")
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.output_len < 3:
        parser.error("--output-len must be at least 3 (a gap and an ITL)")

    rng = random.Random(args.seed)

    def prompts(length: int, count: int) -> list[list[int]]:
        return [[rng.randrange(2, VOCAB_SIZE) for _ in range(length)] for _ in range(count)]

    config = ClusterConfig(
        dtype="float32", port=0, kv_transport=args.transport, kv_push=args.modes[0] == "push",
        engine_args=("--num-kv-blocks", str(args.num_kv_blocks)),
        redis_prefix=f"pdserve-handoff-bench-{time.time_ns()}",
        disaggregation="always",  # every prompt handed off: the cost measured here
    )
    summary: dict[str, object] = {"transport": args.transport, "output_len": args.output_len, "by_mode": {}}
    with LocalCluster(config) as cluster:
        endpoints = {args.modes[0]: cluster.endpoint}
        for mode in args.modes[1:]:
            endpoints[mode] = cluster.start_gateway(f"gateway-{mode}", ["--kv-push" if mode == "push" else "--no-kv-push"])
        # Warm every path (the model's first steps, the channels, the KV buffers) at each length.
        for length in args.prompt_lens:
            for endpoint in endpoints.values():
                asyncio.run(_measure(cluster, endpoint, prompts(length, 2), args.output_len))
        for length in args.prompt_lens:
            # One request at a time, alternating between the modes.
            rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in endpoints}
            for _ in range(args.requests):
                for mode, endpoint in endpoints.items():
                    rows[mode].append(asyncio.run(_measure(cluster, endpoint, prompts(length, 1), args.output_len)))
            for mode, measured in rows.items():
                row = _combine(measured)
                summary["by_mode"].setdefault(mode, {})[str(length)] = row  # type: ignore[union-attr]
                print(f"{mode:>4} {length:>5} prompt tokens: TTFT {row['ttft_p50_ms']:.0f} ms, first->second "
                      f"{row['gap_p50_ms']:.0f} ms, ITL {row['itl_p50_ms']:.1f} ms -> {row['gap_over_itl']:.2f}x; "
                      f"KV taken in {row['kv_fetch_mean_ms']:.1f} ms ({row['kv_mib_per_request']:.1f} MiB, "
                      f"{row['pushed']}/{row['requests']} pushed)", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)


def _combine(rows: list[dict[str, float]]) -> dict[str, float]:
    """Medians over single-request measurements (the ratio of the medians, as before)."""
    combined = {name: statistics.median(row[name] for row in rows) for name in rows[0]}
    combined["requests"] = len(rows)
    combined["pushed"] = sum(row["pushed"] for row in rows)
    combined["gap_over_itl"] = combined["gap_p50_ms"] / combined["itl_p50_ms"]
    return combined


if __name__ == "__main__":
    main()
