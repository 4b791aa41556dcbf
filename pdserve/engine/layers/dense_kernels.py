"""pdserve's dense GEMMs for CPUs (``pdserve/engine/kernels/dense_gemm.c``), bf16 and float32, and the weight layout they read.

Both keep a projection's weight in panels of 32 output rows, a column's (float32)
or a pair of columns' (bf16) values for the panel's rows together: the order a
vector multiply-add reads with the outputs in its lanes, 8 activation rows
sharing each load. Against the libraries torch calls, on a 2-vCPU AMD EPYC
(Zen 4; benchmarks/linear_methods.py, BENCHMARKS.md):

- bf16 on a CPU with AVX512-BF16 and no AMX: 1.2-2.6x oneDNN's prepacked GEMM
  below 64 rows, even with it from 256 to 2,048 (oneDNN's tiles are built for
  large batches; with AMX its tile path stays);
- float32 on AMD CPUs: 1.3-2.8x MKL's packed sgemm at every row count (MKL does
  not run its best code on AMD CPUs; on Intel CPUs MKL stays).

``UnquantizedLinearMethod`` keeps such a layer only in its panels, and the fused
decode step runs bf16 ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.layers.quant_kernels import _PARALLEL_MIN_BYTES
from pdserve.engine.native import KernelOps, cpu_vendor, dispatch_flags, load_kernel_ops

# Output rows of one panel.
PANEL = 32
_BF16_PATHS = {0: "portable", 1: "avx512_bf16"}
_F32_PATHS = {0: "portable", 1: "avx2", 2: "avx512"}


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> the kernel's panels, padded rows zero: bf16 (ceil(out / 32), in / 2, 32, 2) for in even,
    float32 (ceil(out / 32), in, 32)."""
    out_features, in_features = weight.shape
    rows = weight.new_zeros((-(-out_features // PANEL) * PANEL, in_features))
    rows[:out_features] = weight
    if weight.dtype == torch.float32:
        return rows.view(-1, PANEL, in_features).permute(0, 2, 1).contiguous()
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"the dense kernels read float32 or bfloat16 weights, got {weight.dtype}")
    if in_features % 2:
        raise ValueError(f"the bf16 kernel reads input columns in pairs; in_features must be even, got {in_features}")
    return rows.view(-1, PANEL, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_dense(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The (out, in) weight of ``pack_dense``'s panels."""
    if panels.dtype == torch.float32:
        return panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[:out_features]
    num_panels, pairs = panels.shape[:2]
    return panels.permute(0, 2, 1, 3).reshape(num_panels * PANEL, pairs * 2)[:out_features]


class DenseKernels:
    """The kernels of one variant; ``bind`` checks a weight once and returns the product by it as a callable."""

    def __init__(self, kernels: KernelOps) -> None:
        ops, variant = kernels.ops, kernels.variant
        self._functions: dict[torch.dtype, Callable[..., int]] = {
            torch.bfloat16: lambda *args: ops.bf16_gemm(variant, *args),
            torch.float32: lambda *args: ops.f32_gemm(variant, *args),
        }
        # Experts side by side: (out, x, panel addresses, row offsets, experts, n, k, threads), float32.
        self.f32_grouped: Callable[..., int] = lambda *args: ops.f32_grouped_gemm(variant, *args)
        self.variant = kernels.name
        # Which code the variant runs per dtype; the bf16 "portable" path is a reference, never the engine's.
        self.isa = {
            torch.bfloat16: _BF16_PATHS[ops.bf16_path(variant)],
            torch.float32: _F32_PATHS[ops.f32_path(variant)],
        }

    def bind(self, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> BoundDenseGemm:
        """x (rows, in) in the panels' dtype -> x @ W.T + bias (rows, out), summed in float32 (bf16: rounded once)."""
        dtype = panels.dtype
        shape = (PANEL, 2) if dtype == torch.bfloat16 else (PANEL,)
        if (
            dtype not in self._functions or panels.device.type != "cpu" or not panels.is_contiguous()
            or panels.dim() != 2 + len(shape) or panels.shape[0] != -(-out_features // PANEL)
            or panels.shape[2:] != shape
        ):
            raise ValueError(
                f"panels must be contiguous CPU float32 (panels, in, 32) or bf16 (panels, in / 2, 32, 2) "
                f"for {out_features} outputs"
            )
        if bias is not None and (bias.dtype != dtype or bias.shape != (out_features,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous {dtype} of shape ({out_features},)")
        bound = BoundDenseGemm(self._functions[dtype], panels, bias, out_features)
        bound.kernels = self
        return bound


class BoundDenseGemm:
    """The product by one checked weight."""

    def __init__(
        self, function: Callable[..., int], panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> None:
        self.panels, self.bias = panels, bias
        self.dtype = panels.dtype
        self.out_features = out_features
        self.in_features = panels.shape[1] * (2 if self.dtype == torch.bfloat16 else 1)
        self._function = function
        self.kernels: DenseKernels | None = None  # set by DenseKernels.bind: the variant the panels were bound to
        # Small weights stay on one thread, as the quantized kernels' do; the fused decode step reads this too.
        self.parallel = panels.numel() * panels.element_size() >= _PARALLEL_MIN_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (rows, in) -> (rows, out)
        # The C side trusts these layouts; anything else would read the wrong memory.
        if x.device.type != "cpu" or x.dtype != self.dtype or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous CPU {self.dtype} tensor")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be (rows, {self.in_features}), got {tuple(x.shape)}")
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=self.dtype)
        if rows == 0:
            return out
        threads = torch.get_num_threads() if self.parallel else 1
        self._function(out, x, self.panels, self.bias, rows, self.out_features, self.in_features, threads)
        return out


def dense_kernel_serves_this_cpu(dtype: torch.dtype) -> bool:
    """Whether the engine should use the kernel for ``dtype`` here (where it was measured faster than the library):
    bf16 with AVX512-BF16 and no AMX (with AMX oneDNN's tiles win); float32 on AMD CPUs with AVX-512."""
    flags = dispatch_flags()
    if dtype == torch.bfloat16:
        return "avx512_bf16" in flags and "amx_bf16" not in flags
    return dtype == torch.float32 and cpu_vendor() == "AuthenticAMD" and "avx512f" in flags


def load_dense_kernels(variant: str | None = None) -> DenseKernels | None:
    """The kernels at ``variant`` (None: the best this CPU runs; ``pdserve.engine.native.load_kernel_ops``);
    None where this package was built without them."""
    kernels = load_kernel_ops(variant)
    return None if kernels is None else DenseKernels(kernels)
