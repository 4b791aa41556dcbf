"""Time and GB/s to move the KV cache of one prompt between two processes, per transport.

    python -m benchmarks.kv_transfer [--tokens 1024] [--repeats 5] [--transports grpc shm torch_dist]
    python -m benchmarks.kv_transfer --device cuda:0     # GPU to GPU: grpc, shm and cuda_ipc

The layout defaults to SmolLM2-135M's (30 layers, 3 KV heads, head dim 64, float32:
45 KiB per token, 45 MiB for 1,024 tokens). A sender process holds the blocks;
this process fetches them with each transport's receiver, as a decode worker
does, and checks they arrived intact. Reports the median of the repeats. With
``--device cuda:N`` both ends keep the KV on that GPU, as GPU workers do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import grpc
import torch

from pdserve.kv_transfer import INTERNAL_GRPC_OPTIONS, KVHandoff, KVLayout, TransferConfig, make_receiver
from pdserve.protos.pdserve.v1.internal import worker_pb2_grpc


async def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    num_blocks = -(-args.tokens // args.block_size)
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, args.block_size, "float32")
    sender = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.kv_sender", str(args.layers), str(args.kv_heads), str(args.head_dim),
         str(args.block_size), str(num_blocks), args.device],
        stdout=subprocess.PIPE,
    )
    results: dict[str, dict[str, float]] = {}
    try:
        port = int(sender.stdout.readline())  # type: ignore[union-attr]
        expected = torch.randn(layout.tensor_shape(num_blocks), generator=torch.Generator().manual_seed(0))
        handoff = KVHandoff(
            request_id="bench", model_id="bench", layout=layout, block_hashes=(), num_tokens=args.tokens,
            first_token_id=0, transport="grpc", address=f"127.0.0.1:{port}", lease_deadline_ms=2**40,
            worker_id="bench-sender", epoch=1,
        )
        nbytes = expected.numel() * expected.element_size()
        async with grpc.aio.insecure_channel(handoff.address, options=list(INTERNAL_GRPC_OPTIONS)) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            for transport in args.transports:
                receiver = make_receiver(transport, TransferConfig(device=args.device))
                times = []
                for _ in range(args.repeats + 1):  # the first run warms up (pair setup, channel)
                    started = time.perf_counter()
                    blocks = await receiver.fetch(handoff, 0, stub)
                    times.append(time.perf_counter() - started)
                    if not torch.equal(blocks.cpu(), expected):
                        raise AssertionError(f"{transport} delivered different bytes")
                await receiver.close()
                median = statistics.median(times[1:])
                results[transport] = {
                    "seconds": median, "gb_per_s": nbytes / median / 1e9, "bytes": nbytes,
                    # grpc and shm hand the blocks over in host memory; the engine copies them into its pool.
                    "lands_on": str(blocks.device),
                }
    finally:
        sender.terminate()
        sender.wait(timeout=10)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--transports", nargs="+", default=None,
        help="default: grpc shm torch_dist on the CPU, grpc shm cuda_ipc on a GPU",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N: where both ends hold the KV")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.transports is None:
        args.transports = ["grpc", "shm", "torch_dist" if args.device == "cpu" else "cuda_ipc"]
    return args


def main() -> None:
    args = parse_args()
    results = asyncio.run(measure(args))
    print(f"KV of a {args.tokens}-token prompt ({next(iter(results.values()))['bytes'] / 2**20:.1f} MiB), median of {args.repeats}:")
    print(f"{'transport':<12} {'ms':>9} {'GB/s':>8}  lands on")
    for name, row in results.items():
        print(f"{name:<12} {row['seconds'] * 1000:>9.1f} {row['gb_per_s']:>8.2f}  {row['lands_on']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
