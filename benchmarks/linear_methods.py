"""Side-by-side timings of the linear methods' kernels at the engine's projection shapes.

    python -m benchmarks.linear_methods [--threads 2] [--rows 1,8,32,256,2048] [--repeats 7] [--fallback-builds] [--json out.json]

For every projection of the embedded default model (SmolLM2-135M: q/k/v fused
576->960, o 576->576, gate/up fused 576->3072, down 1536->576, LM head
576->49152) and every row count, each candidate kernel runs once per round,
rounds alternating, in this process; the minimum (and median) microseconds are
reported. Weights are random (the kernels' speed does not depend on values)
and hot in cache after the warm-up, as in a decode loop over a small model
whose layer weights fit the L2/L3 only partly, so read the figures as
per-kernel, not per-step. Candidates:

- ``fp32 mkl``: MKL's packed GEMM, the float32 method on CPUs where pdserve's dense kernel does not serve;
- ``fp32 F.linear``; ``bf16 F.linear`` (oneDNN; AMX where present);
- ``bf16 onednn packed``: ``mkldnn._linear_pointwise`` on a weight prepacked by ``mkldnn._reorder_linear_weight``,
  the bf16 method where the dense kernel does not serve;
- ``fp32 dense kernel`` / ``bf16 dense kernel``: pdserve's own (pdserve/engine/kernels/dense_gemm.c), what the
  unquantized method runs where ``dense_kernel_serves_this_cpu`` (the bf16 one only where this CPU has
  AVX512-BF16);
- ``int8 kernel`` / ``int4 kernel``: pdserve's own kernels (pdserve/engine/kernels/quant_gemv.c:
  int8 activations per block of 32, AVX512-VNNI), what the quantized methods run up to
  ``kernel_max_rows``; INT4 at group 32, the default;
- ``aten int8`` / ``aten int4``: aten's weight-only ``_weight_int8pack_mm`` /
  ``_weight_int4pack_mm_for_cpu`` with bf16 activations, which the methods ran before
  (group 32, the weights packed here in aten's layouts);
- ``int8 deq+bf16`` / ``int4 deq+bf16``: the quantized methods' multi-row path,
  dequantizing the weight for the call and running ``F.linear`` (to bf16; to float32
  on a CPU without bf16 units, where the label says ``deq+fp32``);
- with ``--fallback-builds``: ``int8 kernel avx2`` / ``int8 kernel portable`` (and INT4),
  the same kernels built for a CPU without AVX512-VNNI, or without AVX2 either, where
  this CPU runs such a build (same bits; BENCHMARKS.md has AVX2 against portable on a Zen 3).

The LM head is only ever computed for sampled rows (at most max_num_seqs), so it
is not timed at 2,048 rows; the int kernels are not timed at 2,048 rows
either unless ``--slow`` is given (they take tens of ms there).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from benchmarks.decode_step import _alternate
from pdserve.engine.layers.dense_kernels import load_dense_kernels, pack_dense
from pdserve.engine.layers.linear import Int4LinearMethod, Int8LinearMethod, PackedLinear
from pdserve.engine.layers.quant_kernels import load_quant_kernels, unpack_int4, unpack_int8, unpack_rows
from pdserve.engine.native import cpu_has_native_bf16, supported_variants

SHAPES = {
    "q/k/v": (576, 960),
    "o": (576, 576),
    "gate/up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}


def _candidates(in_features: int, out_features: int, rows: int, slow: bool, fallbacks: dict) -> dict:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    weight = linear.weight.detach()
    mkl_weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    weight_bf16 = weight.to(torch.bfloat16)
    dense = load_dense_kernels()
    # oneDNN's prepacked bf16 GEMM needs AVX512-BW/VL/DQ (or AVX-NE-CONVERT); an AVX2 CPU has no such path.
    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    onednn_weight = torch.ops.mkldnn._reorder_linear_weight(weight_bf16, rows) if onednn_bf16 else None
    int8, int4 = PackedLinear([linear], Int8LinearMethod()), PackedLinear([linear], Int4LinearMethod(32))
    x = torch.randn(rows, in_features)
    x_bf16 = x.to(torch.bfloat16)
    kernels = int8._quant_kernels
    # aten's layouts of the same weights: int8 (out, in) with bf16 scales; int4 packed with (groups, out, 2) scale/zero.
    q8 = unpack_int8(int8.qweight, out_features)[:, :in_features].contiguous()
    scales8 = int8.scales[:out_features].to(torch.bfloat16)
    q4 = unpack_int4(int4.qweight, out_features).to(torch.int32)
    aten_int4 = torch._convert_weight_to_int4pack_for_cpu(q4, 2)
    scale4, minimum4 = unpack_rows(int4.scales, out_features).float(), unpack_rows(int4.minimums, out_features).float()
    aten_scales_zeros = torch.stack([scale4.t(), (minimum4 + 8 * scale4).t()], dim=-1).to(torch.bfloat16).contiguous()
    candidates = {
        "fp32 mkl": lambda: torch.ops.mkl._mkl_linear(x, mkl_weight, weight, None, rows),
        "fp32 F.linear": lambda: nn.functional.linear(x, linear.weight),
        "bf16 F.linear": lambda: nn.functional.linear(x_bf16, weight_bf16),
    }
    if dense is not None:
        fp32_dense = dense.bind(pack_dense(weight), None, out_features)
        candidates["fp32 dense kernel"] = lambda: fp32_dense(x)
        if dense.isa[torch.bfloat16] != "portable":
            bf16_dense = dense.bind(pack_dense(weight_bf16), None, out_features)
            candidates["bf16 dense kernel"] = lambda: bf16_dense(x_bf16)
    if onednn_weight is not None:
        candidates["bf16 onednn packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x_bf16, onednn_weight, None, "none", [], ""
        )
    if rows < 2048 or slow:
        if kernels is not None:
            candidates |= {
                "int8 kernel": lambda: kernels.int8_gemm(x_bf16, int8.qweight, int8.scales, out_features),
                "int4 kernel": lambda: kernels.int4_gemm(
                    x_bf16, int4.qweight, int4.scales, int4.minimums, 32, out_features
                ),
            }
        for isa, build in fallbacks.items():
            candidates |= {
                f"int8 kernel {isa}": lambda build=build: build.int8_gemm(x_bf16, int8.qweight, int8.scales, out_features),
                f"int4 kernel {isa}": lambda build=build: build.int4_gemm(
                    x_bf16, int4.qweight, int4.scales, int4.minimums, 32, out_features
                ),
            }
        candidates |= {
            "aten int8": lambda: torch._weight_int8pack_mm(x_bf16, q8, scales8),
            "aten int4": lambda: torch._weight_int4pack_mm_for_cpu(x_bf16, aten_int4, 32, aten_scales_zeros),
        }
    dequantized = "deq+bf16" if cpu_has_native_bf16() else "deq+fp32"
    candidates |= {
        f"int8 {dequantized}": lambda: _force(int8, x_bf16),
        f"int4 {dequantized}": lambda: _force(int4, x_bf16),
    }
    return candidates


def _fallback_builds() -> dict:
    """The kernels' variants for CPUs without AVX512-VNNI (and without AVX2 too), by path, where that path
    differs from this CPU's best variant's."""
    own = load_quant_kernels()
    builds = {}
    for variant in ("avx2", "portable"):
        if variant not in supported_variants():
            continue
        build = load_quant_kernels(variant)
        if build is not None and (own is None or build.isa != own.isa) and build.isa not in builds:
            builds[build.isa] = build
    return builds


def _force(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """The method's multi-row path at any row count."""
    saved = layer.method.kernel_max_rows
    layer.method.kernel_max_rows = 0
    try:
        return layer(x)
    finally:
        layer.method.kernel_max_rows = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8,32,256,2048")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--slow", action="store_true", help="also time the aten int kernels at 2,048 rows")
    parser.add_argument(
        "--fallback-builds", action="store_true", help="also time the kernels' AVX2 and portable builds where they differ"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fallbacks = _fallback_builds() if args.fallback_builds else {}
    results = []
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            in_features, out_features = SHAPES[shape]
            for rows in (int(r) for r in args.rows.split(",")):
                if shape == "lm_head" and rows >= 2048:
                    continue
                timings = _alternate(_candidates(in_features, out_features, rows, args.slow, fallbacks), args.repeats)
                results.append({"shape": shape, "rows": rows, "timings": timings})
                best = min(timings, key=lambda name: timings[name]["min_ms"])
                cells = "  ".join(f"{name}={t['min_ms'] * 1000:.0f}" for name, t in timings.items())
                print(f"{shape:<8} {rows:>5}  best={best:<20} {cells}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"threads": args.threads, "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
