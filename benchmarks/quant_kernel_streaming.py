"""The INT8/INT4 kernels at one to a few rows with their weights streamed from memory, against the bandwidth.

    python -m benchmarks.quant_kernel_streaming [--threads 2] [--rows 1] [--copies 40] [--repeats 10]

A decode step reads every layer's weights once, from DRAM: a 135M-parameter model's
INT8 weights are ~130 MB against a 32 MB L3. ``benchmarks.linear_methods`` times
one weight over and over (hot in cache, or evicted by the other candidates in
between); this one cycles through ``--copies`` distinct random weights of the
default model's gate/up shape (576 -> 3,072), more bytes than the caches hold, and
reports microseconds per call and the GB/s of weight bytes each call reads,
beside ``Tensor.sum``'s read rate over a 512 MiB buffer on the same threads
(``benchmarks/machine_limits.py``). Builds: this machine's own and, with
``--fallback-builds``, the AVX2 and portable ones where they differ.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.linear_methods import _fallback_builds
from benchmarks.machine_limits import BANDWIDTH_BUFFER_BYTES, measure_bandwidth_gbps
from pdserve.engine.layers import quant_kernels as qk

IN_FEATURES, OUT_FEATURES = 576, 3072


def _bound_weights(kernels: qk.QuantKernels, copies: int) -> tuple[list, list]:
    torch.manual_seed(0)
    int8, int4 = [], []
    groups = IN_FEATURES // 32
    for _ in range(copies):
        q8 = torch.randint(-127, 128, (OUT_FEATURES, IN_FEATURES), dtype=torch.int8)
        scales = torch.rand(OUT_FEATURES) * 0.01
        int8.append(kernels.bind_int8(qk.pack_int8(q8), scales, OUT_FEATURES))
        q4 = torch.randint(0, 16, (OUT_FEATURES, IN_FEATURES), dtype=torch.uint8)
        scale = (torch.rand(OUT_FEATURES, groups) * 0.01).half()
        minimum = (torch.rand(OUT_FEATURES, groups) * -0.01).half()
        int4.append(kernels.bind_int4(qk.pack_int4(q4), qk.pack_rows(scale), qk.pack_rows(minimum), 32, OUT_FEATURES))
    return int8, int4


def _per_call_us(gemms: list, x: torch.Tensor, repeats: int) -> float:
    """Best over the repeats of the mean time of one call, cycling through every weight once per repeat."""
    for gemm in gemms:
        gemm(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for gemm in gemms:
            gemm(x)
        best = min(best, (time.perf_counter() - start) / len(gemms))
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--copies", type=int, default=40, help="distinct weights cycled through (40: ~71 MB of INT8)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--fallback-builds", action="store_true", help="also the AVX2 and portable builds")
    args = parser.parse_args()
    if args.threads < 1 or args.rows < 1 or args.copies < 1 or args.repeats < 1:
        parser.error("--threads, --rows, --copies and --repeats must be at least 1")
    torch.set_num_threads(args.threads)
    own = qk.load_quant_kernels()
    if own is None:
        parser.error("the INT8/INT4 kernels are not in this package (built with PDSERVE_BUILD_KERNELS=0?)")
    builds = {own.isa: own} | (_fallback_builds() if args.fallback_builds else {})
    x = torch.randn(args.rows, IN_FEATURES)
    _, sum_gbps = measure_bandwidth_gbps(BANDWIDTH_BUFFER_BYTES, repeats=5)
    print(f"threads {args.threads}, rows {args.rows}, {args.copies} weights of {IN_FEATURES}->{OUT_FEATURES}")
    print(f"Tensor.sum over {BANDWIDTH_BUFFER_BYTES >> 20} MiB: {sum_gbps:.1f} GB/s")
    with torch.inference_mode():
        for isa, kernels in builds.items():
            int8, int4 = _bound_weights(kernels, args.copies)
            for name, gemms, weight_bytes in (
                ("int8", int8, int8[0].tensors[0].numel()),
                ("int4", int4, int4[0].tensors[0].numel()),
            ):
                us = _per_call_us(gemms, x, args.repeats)
                gbps = weight_bytes / us / 1e3
                print(f"{isa:<12} {name}: {us:8.1f} us a call, {gbps:5.1f} GB/s of weights ({gbps / sum_gbps:.0%} of sum)")
            del int8, int4


if __name__ == "__main__":
    main()
