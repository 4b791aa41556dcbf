"""INT8/INT4 weight GEMV and small GEMM on CPU (``pdserve/engine/kernels/quant_gemv.c``), and the weight layout they read.

The kernel quantizes the activation to int8 per block of 32 (llama.cpp's Q8
approach) and multiplies with AVX512-VNNI int8 dot products, 16 output rows a
vector; without VNNI it computes the same integer sums with AVX2, or in portable
C on a CPU without that (``QuantKernels.isa`` says which; the kernels' variant,
``pdserve.engine.native``, decides). Its weight
layout (tiles of 16 output rows, per block of 32 input columns; the C file's
header has the byte order) is what ``Int8LinearMethod`` / ``Int4LinearMethod``
keep; ``unpack_int8`` / ``unpack_int4`` turn it back into (out, in) integers for
the dequantized paths (prefill-sized batches, no kernel, GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.native import KernelOps, load_kernel_ops

# The kernel's activation quantization block (input columns) and the output rows of one weight tile.
QBLOCK = 32
TILE = 16
# Below this many weight bytes a call stays on one thread (a fork/join costs more than it saves).
_PARALLEL_MIN_BYTES = 64 * 1024


def padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def pack_int8(qweight: torch.Tensor) -> torch.Tensor:
    """(out, in) int8, in % 32 == 0 -> the kernel's tiles: (out_pad / 16, in / 32, 8, 16, 4) uint8 of w + 128."""
    out_features, in_features = qweight.shape
    rows = torch.zeros(padded(out_features, TILE), in_features, dtype=torch.int16)
    rows[:out_features] = qweight
    tiles = (rows + 128).to(torch.uint8).view(-1, TILE, in_features // QBLOCK, 8, 4)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


def unpack_int8(tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """The (out, in) int8 values of ``pack_int8``'s tiles."""
    num_tiles, blocks = tiles.shape[:2]
    rows = tiles.permute(0, 3, 1, 2, 4).reshape(num_tiles * TILE, blocks * QBLOCK)
    return (rows[:out_features].to(torch.int16) - 128).to(torch.int8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) integers in [0, 15], in % 32 == 0 -> the kernel's tiles: (out_pad / 16, in / 32, 4, 16, 4) uint8.

    Byte i of a row in chunk c holds column c*8 + i (low nibble) and c*8 + 4 + i (high nibble)."""
    out_features, in_features = q.shape
    rows = torch.zeros(padded(out_features, TILE), in_features, dtype=torch.uint8)
    rows[:out_features] = q
    halves = rows.view(-1, TILE, in_features // QBLOCK, 4, 2, 4)  # (tiles, row, block, chunk, half, byte)
    bytes_ = halves[..., 0, :] | (halves[..., 1, :] << 4)
    return bytes_.permute(0, 2, 3, 1, 4).contiguous()


def unpack_int4(tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """The (out, in) uint8 values in [0, 15] of ``pack_int4``'s tiles."""
    num_tiles, blocks = tiles.shape[:2]
    bytes_ = tiles.permute(0, 3, 1, 2, 4)  # (tiles, row, block, chunk, byte)
    halves = torch.stack([bytes_ & 15, bytes_ >> 4], dim=-2)  # (tiles, row, block, chunk, half, byte)
    return halves.reshape(num_tiles * TILE, blocks * QBLOCK)[:out_features]


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """(out, groups) per-row values -> (out_pad / 16, groups, 16): each tile's 16 rows side by side, zeros padding."""
    out_features, groups = values.shape
    rows = values.new_zeros(padded(out_features, TILE), groups)
    rows[:out_features] = values
    return rows.view(-1, TILE, groups).transpose(1, 2).contiguous()


def unpack_rows(tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """The (out, groups) values of ``pack_rows``' tiles."""
    return tiles.transpose(1, 2).reshape(-1, tiles.shape[1])[:out_features]


# pdserve_quant_path()'s answers.
_QUANT_PATHS = {2: "avx512_vnni", 1: "avx2", 0: "portable"}


class QuantKernels:
    """The INT8/INT4 kernels of one variant; the caller passes tensors in ``pack_*``'s layouts (checked by shape).

    ``bind_int8`` / ``bind_int4`` check a weight once and return the product by it
    as a callable: at batch 1 a projection costs tens of microseconds, so the
    per-call Python work is kept to the activation's checks and one operator call.
    """

    def __init__(self, kernels: KernelOps) -> None:
        ops, variant = kernels.ops, kernels.variant
        self._int8: Callable[..., int] = lambda *args: ops.int8_gemm(variant, *args)
        self._int4: Callable[..., int] = lambda *args: ops.int4_gemm(variant, *args)
        # Every expert of a layer in one call (linear.GroupedQuantizedGemm); arguments as the operators'.
        self.int8_grouped: Callable[..., int] = lambda *args: ops.int8_grouped_gemm(variant, *args)
        self.int4_grouped: Callable[..., int] = lambda *args: ops.int4_grouped_gemm(variant, *args)
        self.variant = kernels.name
        # Which integer-product code the variant runs.
        self.isa = _QUANT_PATHS[ops.quant_path(variant)]

    def bind_int8(self, tiles: torch.Tensor, row_scales: torch.Tensor, out_features: int) -> BoundGemm:
        """x (rows, in) float32/bf16 -> x @ W.T (rows, out) in x's dtype; W = (tiles - 128) * row_scales[:, None]."""
        _check_tiles(tiles, out_features, 8)
        if row_scales.dtype != torch.float32 or row_scales.shape != (tiles.shape[0] * TILE,):
            raise ValueError("row_scales must be float32, one per padded output row")
        return BoundGemm(self._int8, (tiles, row_scales), (), out_features, tiles.shape[1] * QBLOCK)

    def bind_int4(
        self,
        tiles: torch.Tensor,
        scales: torch.Tensor,  # (tiles, groups, 16) float16
        minimums: torch.Tensor,  # (tiles, groups, 16) float16
        group_size: int,
        out_features: int,
    ) -> BoundGemm:
        """x (rows, in) float32/bf16 -> x @ W.T (rows, out) in x's dtype; W = scale * q + minimum per group."""
        _check_tiles(tiles, out_features, 4)
        in_features = tiles.shape[1] * QBLOCK
        if group_size % QBLOCK or in_features % group_size:
            raise ValueError(f"group_size must be a multiple of {QBLOCK} dividing {in_features}, got {group_size}")
        shape = (tiles.shape[0], in_features // group_size, TILE)
        for name, tensor in (("scales", scales), ("minimums", minimums)):
            if tensor.dtype != torch.float16 or tensor.shape != shape or not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous float16 of shape {shape}")
        return BoundGemm(self._int4, (tiles, scales, minimums), (group_size,), out_features, in_features)

    def int8_gemm(self, x: torch.Tensor, tiles: torch.Tensor, row_scales: torch.Tensor, out_features: int) -> torch.Tensor:
        """``bind_int8``'s product, for one call."""
        return self.bind_int8(tiles, row_scales, out_features)(x)

    def int4_gemm(
        self,
        x: torch.Tensor,
        tiles: torch.Tensor,
        scales: torch.Tensor,
        minimums: torch.Tensor,
        group_size: int,
        out_features: int,
    ) -> torch.Tensor:
        """``bind_int4``'s product, for one call."""
        return self.bind_int4(tiles, scales, minimums, group_size, out_features)(x)


class BoundGemm:
    """The product by one checked weight."""

    def __init__(
        self, function: Callable[..., int], tensors: tuple[torch.Tensor, ...], options: tuple[int, ...],
        out_features: int, in_features: int,
    ) -> None:
        self.tensors = tensors
        self.out_features, self.in_features = out_features, in_features
        self._function = function
        self._weight_args = (*tensors, *options)
        self._parallel = tensors[0].numel() >= _PARALLEL_MIN_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (rows, in) -> (rows, out)
        _check_activation(x, self.in_features)
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=x.dtype)
        if rows == 0:
            return out
        # Small weights stay on one thread; others follow torch's current thread count.
        threads = torch.get_num_threads() if self._parallel else 1
        status = self._function(
            out, x, *self._weight_args, rows, self.out_features, self.in_features, int(x.dtype == torch.bfloat16),
            threads,
        )
        if status != 0:
            raise MemoryError("the quantized kernel could not allocate its int8 activation")
        return out


def _check_tiles(tiles: torch.Tensor, out_features: int, chunks: int) -> None:
    if (
        tiles.device.type != "cpu" or tiles.dtype != torch.uint8 or not tiles.is_contiguous() or tiles.dim() != 5
        or tiles.shape[0] != -(-out_features // TILE) or tiles.shape[2:] != (chunks, TILE, 4)
    ):
        raise ValueError(f"tiles must be contiguous CPU uint8 of shape (tiles, blocks, {chunks}, 16, 4) for {out_features} outputs")


def _check_activation(x: torch.Tensor, in_features: int) -> tuple[int, int]:
    # The C side trusts these layouts; anything else would read the wrong memory.
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError("x must be a contiguous CPU float32 or bfloat16 tensor")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be (rows, {in_features}), got {tuple(x.shape)}")
    return x.shape[0], x.shape[1]


def load_quant_kernels(variant: str | None = None) -> QuantKernels | None:
    """The kernels at ``variant`` (None: the best this CPU runs; ``pdserve.engine.native.load_kernel_ops``);
    None where this package was built without them."""
    kernels = load_kernel_ops(variant)
    return None if kernels is None else QuantKernels(kernels)
