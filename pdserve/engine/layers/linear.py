"""How a projection stores its weights and multiplies: one ``LinearMethod`` per precision or quantization.

``PackedLinear`` is the projection the model calls (``self.qkv_proj(x)``): the
loaded ``nn.Linear`` layers that read the same input, fused into one
(sum of out_features, in_features) matrix. What happens to that matrix after
loading, and how a forward multiplies by it, belongs to its ``LinearMethod``
(vLLM's ``LinearMethodBase`` shape: process the weights once after loading,
then ``apply``):

- ``UnquantizedLinearMethod``: the checkpoint's floats in the model dtype.
  On CPU in float32 the matrix is also kept in MKL's packed GEMM format, and
  in bf16 as oneDNN's prepacked GEMM (on the AMX tile units where the CPU has
  them), except where pdserve's own dense kernel serves better (bf16 on
  AVX512-BF16 without AMX, float32 on AMD CPUs with AVX-512): it keeps the
  only copy (pdserve/engine/layers/dense_kernels.py; benchmarks/linear_methods.py).
- ``Int8LinearMethod``: weight-only INT8, one symmetric scale per output channel.
- ``Int4LinearMethod``: weight-only INT4, asymmetric, a float16 scale and
  minimum per ``group_size`` input columns of each output channel (Q4_1's form).

The quantized methods keep their weights in the layout of pdserve's own CPU
kernels (pdserve/engine/layers/quant_kernels.py, pdserve/engine/kernels/quant_gemv.c) and
dispatch by row count: up to ``kernel_max_rows`` rows (every row count on a
CPU with AVX512-VNNI and no AMX, else decode batches) the kernel reads the
small weights directly, the activation quantized to int8 per
block of 32 (llama.cpp's Q8 approach; AVX512-VNNI dot products); above it, and
wherever the kernel cannot run (GPU, a package built without its kernels), the weights are
dequantized for this call only and multiplied by ``F.linear`` (no dequantized
copy is kept, so the memory saving holds): to bf16, or to float32 on a CPU
without bf16 units, where oneDNN emulates bf16 at several times float32's cost.
"""

from __future__ import annotations

import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pdserve.engine.layers.dense_kernels import (
    BoundDenseGemm,
    DenseKernels,
    dense_kernel_serves_this_cpu,
    load_dense_kernels,
    pack_dense,
)
from pdserve.engine.layers.quant_kernels import (
    _PARALLEL_MIN_BYTES,
    QBLOCK,
    TILE,
    BoundGemm,
    QuantKernels,
    load_quant_kernels,
    pack_int4,
    pack_int8,
    pack_rows,
    padded,
    unpack_int4,
    unpack_int8,
    unpack_rows,
)
from pdserve.engine.native import cpu_has_native_bf16, dispatch_flags
from pdserve.engine.types.config import INT4_GROUP_SIZES

logger = logging.getLogger(__name__)

# A typical decode batch; see _mkl_packed.
_MKL_PACK_BATCH_SIZE = 32
# Above these many rows the quantized methods dequantize to bf16 and use the
# bf16 GEMM; at or below them pdserve's int8 kernels win. Where the CPU has
# AVX512-VNNI and no AMX the kernels win at every row count (on a Zen 4,
# at 2,048 rows INT8 1.7x and INT4 1.5x faster than dequantizing, and faster
# than the bf16 kernel: benchmarks/linear_methods.py --slow), so there they take
# every row count (see quant_kernel_max_rows); with AMX tiles the cut-off stays
# where it was measured, 256 rows.
INT8_KERNEL_MAX_ROWS = 256
INT4_KERNEL_MAX_ROWS = 256
# On a CPU without VNNI or bf16 units (AVX2 only) the methods dequantize to float32: there the INT4
# kernel beats that at every row count (gate/up at 2,048 rows 34.5 ms against 39.3) and the INT8 kernel
# up to 512 rows (10.8 ms against 13.0 at 512, 42.3 against 40.5 at 2,048); BENCHMARKS.md, linear_methods
# with the AVX2 variant forced.
INT8_AVX2_KERNEL_MAX_ROWS = 512
LM_HEAD_KERNEL_MAX_ROWS = 256
# A kernel_max_rows no batch reaches.
NO_ROW_LIMIT = 2**62
# The quantized methods' dequantized GEMMs, and the kernels' input for an activation
# dtype they do not read (float16): bf16 runs on the AMX/AVX512-BF16 units (6.5x
# float32 at 2,048 rows with AMX, 2.3x on a Zen 4: benchmarks/linear_methods.py); see _dequantized_dtype.
_GEMM_DTYPE = torch.bfloat16


class LinearMethod(ABC):
    """How a ``PackedLinear`` keeps its fused weight and multiplies by it.

    ``process_weights_after_loading`` runs once, when the layer is built from
    loaded float weights (``layer.weight``: (out, in), ``layer.bias``: (out,)
    or None); it may replace ``layer.weight`` with whatever the method keeps.
    ``apply`` computes ``x @ W.T + bias`` for x of shape (rows, in).
    """

    @abstractmethod
    def process_weights_after_loading(self, layer: PackedLinear) -> None: ...

    @abstractmethod
    def apply(self, layer: PackedLinear, x: torch.Tensor) -> torch.Tensor: ...


class UnquantizedLinearMethod(LinearMethod):
    """The weights as loaded, in the model dtype.

    On CPU, where pdserve's dense kernel beats the library torch calls
    (pdserve/engine/layers/dense_kernels.py: bf16 with AVX512-BF16 and no AMX, float32
    on AMD CPUs with AVX-512), the weight is kept only in the kernel's panels
    and every row count runs on it (float32 sums, in an order of its own).
    Otherwise float32 is an MKL packed GEMM, and bf16 a oneDNN prepacked GEMM
    (bit for bit ``F.linear``'s result, about 20% faster at 1-256 rows,
    benchmarks/linear_methods.py). ``F.linear`` elsewhere.
    """

    def process_weights_after_loading(self, layer: PackedLinear) -> None:
        layer.out_features, layer.in_features = layer.weight.shape
        layer._dense_gemm = _dense_kernel_gemm(layer.weight, layer.bias)
        if layer._dense_gemm is not None:
            # The panels are the one copy (a tied head's embedding stays with the embedding layer); a buffer,
            # so that the model's buffers account for them, but not a checkpoint entry.
            del layer.weight
            layer.register_buffer("dense_panels", layer._dense_gemm.panels, persistent=False)
            return
        layer._mkl_weight = _mkl_packed(layer.weight)
        layer._onednn_weight = _onednn_packed(layer.weight)

    def apply(self, layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        gemm = layer._dense_gemm
        if gemm is not None:
            out = gemm(x.to(gemm.dtype).contiguous())
            return out if x.dtype == gemm.dtype else out.to(x.dtype)
        if layer._onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer._onednn_weight, layer.bias, "none", [], "")
        if layer._mkl_weight is None:
            return nn.functional.linear(x, layer.weight, layer.bias)
        # The last argument names the batch size the packed weight serves; the
        # op falls back to F.linear for any other, so it is always this batch's.
        return torch.ops.mkl._mkl_linear(x, layer._mkl_weight, layer.weight, layer.bias, x.shape[0])


class Int8LinearMethod(LinearMethod):
    """Weight-only INT8: ``W ≈ q * scales[:, None]``, q in [-127, 127], one float32 scale per output row.

    Kept in the CPU kernel's tiles (pdserve/engine/layers/quant_kernels.py): ``qweight``
    (out / 16, in / 32, 8, 16, 4) uint8 holding q + 128, rows padded to 16 and
    columns to 32 with zeros; ``scales`` (padded out,) float32.
    """

    def __init__(self, kernel_max_rows: int | None = None) -> None:
        self.kernel_max_rows = quant_kernel_max_rows("int8") if kernel_max_rows is None else kernel_max_rows

    def process_weights_after_loading(self, layer: PackedLinear) -> None:
        weight = layer.weight.detach().to(torch.float32)  # (out, in)
        out_features, in_features = weight.shape
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # (out,)
        q = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        q = nn.functional.pad(q, (0, padded(in_features, QBLOCK) - in_features))  # zero columns: no effect
        del layer.weight
        layer.register_buffer("qweight", pack_int8(q.cpu()).to(q.device))
        row_scales = scales.new_zeros(padded(out_features, TILE))
        row_scales[:out_features] = scales
        layer.register_buffer("scales", row_scales)
        _set_quantized_layer(layer, in_features, out_features)

    def apply(self, layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        kernels = layer._quant_kernels
        if kernels is not None and x.shape[0] <= self.kernel_max_rows:
            gemm = _bound(layer, lambda: kernels.bind_int8(layer.qweight, layer.scales, layer.out_features))
            out = _kernel_output(gemm(_kernel_input(gemm, x)), x)
        else:
            dtype = _dequantized_dtype(x)
            weight = self._dequantize(layer, dtype)
            out = nn.functional.linear(x.to(dtype), weight).to(x.dtype)
        return out if layer.bias is None else out.add_(layer.bias)

    @staticmethod
    def dequantize(layer: PackedLinear) -> torch.Tensor:
        """The float32 weight the method multiplies by: (out, in)."""
        return Int8LinearMethod._dequantize(layer, torch.float32)

    @staticmethod
    def _dequantize(layer: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
        q = unpack_int8(layer.qweight, layer.out_features)[:, : layer.in_features]
        return q.to(dtype).mul_(layer.scales[: layer.out_features, None].to(dtype))


class Int4LinearMethod(LinearMethod):
    """Weight-only INT4, group-wise: ``W ≈ scale * q + minimum`` per ``group_size`` input columns, q in [0, 15].

    Q4_1's form (a float16 scale and minimum per group; at group 32 the blocks
    of the default model's GGUF come back exactly). Kept in the CPU kernel's
    tiles (pdserve/engine/layers/quant_kernels.py): ``qweight`` (out / 16, in / 32, 4,
    16, 4) uint8, two values a byte, rows padded to 16; ``scales`` and
    ``minimums`` (out / 16, in / group_size, 16) float16.
    """

    def __init__(self, group_size: int, kernel_max_rows: int | None = None) -> None:
        self.group_size = group_size
        self.kernel_max_rows = quant_kernel_max_rows("int4") if kernel_max_rows is None else kernel_max_rows

    def process_weights_after_loading(self, layer: PackedLinear) -> None:
        out_features, in_features = layer.weight.shape
        check_int4_group_size(in_features, self.group_size)
        weight = layer.weight.detach().to(torch.float32).view(out_features, in_features // self.group_size, self.group_size)
        low, high = weight.amin(dim=2), weight.amax(dim=2)  # (out, groups)
        # Rounded to float16 first, so that q is chosen for the scale and minimum that are kept.
        scale = _to_float16("scale", ((high - low) / 15.0).clamp(min=_FLOAT16_SMALLEST))
        minimum = _to_float16("minimum", low)
        q = torch.round((weight - minimum.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
        del layer.weight
        layer.register_buffer("qweight", pack_int4(q.to(torch.uint8).view(out_features, in_features).cpu()).to(q.device))
        layer.register_buffer("scales", pack_rows(scale))
        layer.register_buffer("minimums", pack_rows(minimum))
        _set_quantized_layer(layer, in_features, out_features)

    def apply(self, layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        kernels = layer._quant_kernels
        if kernels is not None and x.shape[0] <= self.kernel_max_rows:
            gemm = _bound(
                layer,
                lambda: kernels.bind_int4(layer.qweight, layer.scales, layer.minimums, self.group_size, layer.out_features),
            )
            out = _kernel_output(gemm(_kernel_input(gemm, x)), x)
        else:
            dtype = _dequantized_dtype(x)
            weight = self._dequantize(layer, dtype)
            out = nn.functional.linear(x.to(dtype), weight).to(x.dtype)
        return out if layer.bias is None else out.add_(layer.bias)

    def dequantize(self, layer: PackedLinear) -> torch.Tensor:
        """The float32 weight the method multiplies by: (out, in)."""
        return self._dequantize(layer, torch.float32)

    def _dequantize(self, layer: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
        out_features, in_features = layer.out_features, layer.in_features
        groups = in_features // self.group_size
        scale = unpack_rows(layer.scales, out_features).to(dtype)[..., None]  # (out, groups, 1)
        minimum = unpack_rows(layer.minimums, out_features).to(dtype)[..., None]
        q = unpack_int4(layer.qweight, out_features).view(out_features, groups, self.group_size)
        # In place on the fresh copy: two passes over the weight after the unpacking.
        return q.to(dtype).mul_(scale).add_(minimum).view(out_features, in_features)


# The smallest positive float16 (a subnormal): the scale of a constant group.
_FLOAT16_SMALLEST = 2.0**-24


def _to_float16(name: str, values: torch.Tensor) -> torch.Tensor:
    if not bool(values.abs().le(torch.finfo(torch.float16).max).all()):
        raise ValueError(
            f"quantization='int4' keeps each group's {name} in float16; this checkpoint has a {name} of magnitude "
            f"{float(values.abs().max()):.3g}, above float16's {torch.finfo(torch.float16).max:.0f}"
        )
    return values.to(torch.float16)


def _set_quantized_layer(layer: PackedLinear, in_features: int, out_features: int) -> None:
    layer.in_features, layer.out_features = in_features, out_features
    layer._mkl_weight = None
    # The C kernels serve CPU layers; elsewhere (or without a compiler) the methods dequantize.
    layer._quant_kernels = load_quant_kernels() if layer.qweight.device.type == "cpu" else None


def _bound(layer: PackedLinear, bind: Callable[[], BoundGemm]) -> BoundGemm:
    """The layer's weight bound to its kernel, bound again if its buffers were replaced since."""
    gemm = layer._bound_gemm
    if gemm is None or gemm.tensors[0] is not layer.qweight:
        gemm = layer._bound_gemm = bind()
    return gemm


def _dequantized_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a quantized layer dequantizes to for ``F.linear``: bf16, except on a CPU without bf16 units,
    where oneDNN emulates bf16 products (3-10x slower than float32 at 32-2,048 rows on an AVX2 EPYC
    (Zen 3; benchmarks/linear_methods.py, BENCHMARKS.md): float32 there, bf16 activations widened exactly and the
    product rounded back to bf16 once, as a bf16 GEMM's float32 accumulator is."""
    if x.device.type == "cpu" and not cpu_has_native_bf16():
        return torch.float32
    return _GEMM_DTYPE


def _kernel_input(gemm: BoundGemm, x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: contiguous float32 or bf16, columns padded to the tiles' width."""
    if x.dtype not in _KERNEL_DTYPES:
        x = x.to(_GEMM_DTYPE)
    padding = gemm.in_features - x.shape[1]
    return nn.functional.pad(x, (0, padding)) if padding else x.contiguous()


def _kernel_output(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out if out.dtype == x.dtype else out.to(x.dtype)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """Linear layers that read the same input, as one matrix: (sum of out_features, in_features).

    Built from loaded ``nn.Linear`` layers by the model's ``pack_weights``; the
    output's columns are the layers' outputs side by side, in the order given.
    ``method`` decides how the fused matrix is kept and multiplied (default:
    unquantized, which on CPU float32 keeps MKL's packed GEMM format; results
    agree with ``F.linear`` to float32 rounding, tests/unit/test_packed_linear.py).
    A single layer's weight is not copied (a tied LM head stays the embedding's tensor).
    """

    def __init__(self, linears: list[nn.Linear], method: LinearMethod | None = None) -> None:
        super().__init__()
        weights = [linear.weight.detach() for linear in linears]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)  # (sum out, in)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias: nn.Parameter | None = None
        if any(linear.bias is not None for linear in linears):
            biases = [
                linear.bias.detach() if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
                for linear in linears
            ]
            self.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
        self.method = method or UnquantizedLinearMethod()
        self._mkl_weight: torch.Tensor | None = None
        self._onednn_weight: torch.Tensor | None = None
        self._dense_gemm: BoundDenseGemm | None = None
        self._quant_kernels: QuantKernels | None = None
        self._bound_gemm: BoundGemm | None = None
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (num_tokens, in) -> (num_tokens, sum out)
        return self.method.apply(self, x)

    def weight_bytes(self) -> int:
        """Bytes of the tensors this layer keeps for its weight and bias (packed GEMM copies counted at their dense size)."""
        tensors = [*self.parameters(recurse=False), *self.buffers(recurse=False)]
        tensors += [t for t in (self._mkl_weight, self._onednn_weight) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


# The two private aten ops below (MKL's packed sgemm, oneDNN's prepacked bf16 GEMM) are kept because
# benchmarks/linear_methods.py measures them faster than F.linear on these shapes; each is packed in one
# function here, which gives None (and so F.linear, the public fallback) where the op does not apply or this
# torch lacks it. tests/unit/test_linear_methods.py checks both give F.linear's tokens.


def _mkl_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in MKL's packed GEMM format, or None where that does not apply (GPU, half precision, no MKL)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return None
    try:
        # The batch size is a hint for MKL's blocking; a packed matrix computes correctly for any batch size.
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, _MKL_PACK_BATCH_SIZE)
    except (AttributeError, RuntimeError) as error:  # a torch without the private op
        logger.warning("MKL's packed GEMM is unavailable (%s); float32 projections use F.linear", error)
        return None


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` prepacked for oneDNN's bf16 GEMM (AMX/AVX512-BF16), or None where that does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        # As for MKL, the batch size is a blocking hint; any batch size computes correctly.
        return torch.ops.mkldnn._reorder_linear_weight(weight, _MKL_PACK_BATCH_SIZE)
    except (AttributeError, RuntimeError) as error:  # a torch without the private op
        logger.warning("oneDNN's prepacked bf16 GEMM is unavailable (%s); bf16 projections use F.linear", error)
        return None


def _dense_kernel_gemm(weight: torch.Tensor, bias: torch.Tensor | None) -> BoundDenseGemm | None:
    """The product by ``weight`` through pdserve's dense kernel, or None where the library torch calls serves
    better or the kernel cannot run (not CPU, another dtype, a bf16 weight of odd width, no kernels built)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if (weight.dtype == torch.bfloat16 and weight.shape[1] % 2) or (bias is not None and bias.dtype != weight.dtype):
        return None
    kernels = _dense_kernels(weight.dtype)
    if kernels is None:
        return None
    return kernels.bind(pack_dense(weight.detach()), None if bias is None else bias.detach().contiguous(), weight.shape[0])


def _dense_kernels(dtype: torch.dtype) -> DenseKernels | None:
    """The dense kernels where they beat the library for ``dtype`` on this CPU, built for it (tests replace this
    function to run them on other CPUs)."""
    if not dense_kernel_serves_this_cpu(dtype):
        return None
    return load_dense_kernels()


def check_int4_group_size(in_features: int, group_size: int) -> None:
    """ValueError unless ``group_size`` can quantize a projection with ``in_features`` inputs."""
    if group_size not in INT4_GROUP_SIZES or in_features % group_size:
        raise ValueError(
            f"quantization_group_size={group_size} cannot serve a projection with in_features={in_features}: "
            f"it must be one of {INT4_GROUP_SIZES} and divide in_features"
        )


def quant_kernel_max_rows(kind: str) -> int:
    """The quantized methods' default ``kernel_max_rows`` for ``kind`` ("int8" or "int4"): every row count on a
    CPU with AVX512-VNNI and no AMX tiles (the kernels measured fastest there at prefill sizes too); the
    measured cut-off with AMX tiles; on a CPU with neither VNNI nor bf16 units (AVX2 only), every row count
    for INT4 and ``INT8_AVX2_KERNEL_MAX_ROWS`` for INT8. Reads ``dispatch_flags()``, so a forced
    ``PDSERVE_CPU_ISA`` chooses as the smaller CPU would."""
    flags = dispatch_flags()
    if flags & {"amx_bf16", "amx_int8"}:
        return INT8_KERNEL_MAX_ROWS if kind == "int8" else INT4_KERNEL_MAX_ROWS
    if "avx512_vnni" in flags or kind == "int4":
        return NO_ROW_LIMIT
    return INT8_AVX2_KERNEL_MAX_ROWS


def linear_method(quantization: str | None, group_size: int) -> LinearMethod:
    """The method for the model's decoder projections."""
    if quantization is None:
        return UnquantizedLinearMethod()
    if quantization == "int8":
        return Int8LinearMethod()
    if quantization == "int4":
        return Int4LinearMethod(group_size)
    raise ValueError(f"quantization must be None, 'int8' or 'int4', got {quantization!r}")


def lm_head_method(quantization: str | None, quantize_lm_head: bool = True) -> LinearMethod:
    """The method for the LM head: INT8 per output channel under quantization='int8'/'int4' (as llama.cpp's
    GGUF files keep it in Q8_0), unquantized otherwise or with ``quantize_lm_head=False`` (vLLM's choice)."""
    if quantization is None or not quantize_lm_head:
        return UnquantizedLinearMethod()
    linear_method(quantization, INT4_GROUP_SIZES[0])  # the same error for an unknown setting
    return Int8LinearMethod(kernel_max_rows=LM_HEAD_KERNEL_MAX_ROWS)


class GroupedQuantizedGemm:
    """One projection of every expert of a mixture-of-experts layer (``PackedLinear`` layers of one quantized
    method, one shape, no bias), multiplied in one kernel call: rows ``offsets[e]`` to ``offsets[e + 1]`` of
    x go through expert e. Each row's result is the bits ``layers[e]`` alone would give it (the kernels'
    ``*_grouped_gemm``); ``max_rows`` is the methods' ``kernel_max_rows``, above which they dequantize
    instead, so the caller keeps to it."""

    def __init__(self, layers: list[PackedLinear]) -> None:
        method = layers[0].method
        kernels = layers[0]._quant_kernels
        assert kernels is not None and isinstance(method, (Int8LinearMethod, Int4LinearMethod))
        self.out_features, self.in_features = layers[0].out_features, layers[0].in_features
        self.max_rows = method.kernel_max_rows
        # The tensors themselves are kept: the addresses handed to the kernel stay theirs.
        self._tensors = [(layer.qweight, layer.scales, getattr(layer, "minimums", None)) for layer in layers]
        self._weights = _addresses(qweight for qweight, _, _ in self._tensors)
        self._scales = _addresses(scales for _, scales, _ in self._tensors)
        self._minimums = _addresses(minimums for _, _, minimums in self._tensors)  # INT4 only
        self._num_experts = len(layers)
        self._parallel = layers[0].qweight.numel() * len(layers) >= _PARALLEL_MIN_BYTES
        if isinstance(method, Int8LinearMethod):
            self._call = lambda out, x, offsets, threads: kernels.int8_grouped(
                out, x, self._weights, self._scales, offsets, self._num_experts, self.out_features,
                self.in_features, int(x.dtype == torch.bfloat16), threads,
            )
        else:
            group_size = method.group_size
            self._call = lambda out, x, offsets, threads: kernels.int4_grouped(
                out, x, self._weights, self._scales, self._minimums, group_size, offsets, self._num_experts,
                self.out_features, self.in_features, int(x.dtype == torch.bfloat16), threads,
            )

    @staticmethod
    def serves(layers: list[PackedLinear]) -> bool:
        """Whether the layers can be multiplied in one call: one quantized method kind with kernels on CPU, one
        shape, no bias, inputs a whole number of the kernels' blocks."""
        first = layers[0]
        method = first.method
        if not isinstance(method, (Int8LinearMethod, Int4LinearMethod)) or first._quant_kernels is None:
            return False
        return all(
            type(layer.method) is type(method)
            and getattr(layer.method, "group_size", None) == getattr(method, "group_size", None)
            and layer.method.kernel_max_rows == method.kernel_max_rows
            and (layer.out_features, layer.in_features) == (first.out_features, first.in_features)
            and layer.bias is None and layer._quant_kernels is not None
            for layer in layers
        ) and first.in_features % QBLOCK == 0

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # (rows, in) -> (rows, out)
        source = x if x.dtype in _KERNEL_DTYPES else x.to(_GEMM_DTYPE)
        source = source.contiguous()
        out = torch.empty((source.shape[0], self.out_features), dtype=source.dtype)
        threads = torch.get_num_threads() if self._parallel else 1
        if self._call(out, source, offsets, threads) != 0:
            raise MemoryError("the quantized kernel could not allocate its int8 activation")
        return _kernel_output(out, x)


class GroupedDenseGemm:
    """One projection of every expert of a mixture-of-experts layer in float32 (``PackedLinear`` layers whose
    weights are the dense kernel's panels, one shape, no bias: where ``UnquantizedLinearMethod`` keeps float32
    in panels, AMD CPUs with AVX-512), multiplied in one kernel call: rows ``offsets[e]`` to ``offsets[e + 1]``
    of x go through expert e, each row's result the bits ``layers[e]`` alone gives it
    (``pdserve_f32_grouped_gemm``). Any row count."""

    max_rows = sys.maxsize

    def __init__(self, layers: list[PackedLinear]) -> None:
        gemms = [layer._dense_gemm for layer in layers]
        assert all(gemm is not None for gemm in gemms)
        first = gemms[0]
        assert first is not None and first.kernels is not None
        self.out_features, self.in_features = first.out_features, first.in_features
        self._panels = [gemm.panels for gemm in gemms if gemm is not None]  # kept: their addresses are handed over
        self._weights = _addresses(self._panels)
        self._num_experts = len(layers)
        self._call = first.kernels.f32_grouped
        self._parallel = any(gemm.parallel for gemm in gemms if gemm is not None) or (
            sum(panels.numel() for panels in self._panels) * 4 >= _PARALLEL_MIN_BYTES
        )

    @staticmethod
    def serves(layers: list[PackedLinear]) -> bool:
        """Whether the layers can be multiplied in one call: float32 panels of one kernel build, one shape, no bias."""
        gemms = [layer._dense_gemm for layer in layers]
        first = gemms[0]
        return first is not None and first.dtype == torch.float32 and first.kernels is not None and all(
            gemm is not None and gemm.dtype == torch.float32 and gemm.kernels is not None
            and gemm.kernels.variant == first.kernels.variant
            and gemm.bias is None and (gemm.out_features, gemm.in_features) == (first.out_features, first.in_features)
            for gemm in gemms
        )

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # (rows, in) -> (rows, out)
        source = x.to(torch.float32).contiguous()
        if source.shape[1] != self.in_features or offsets.shape != (self._num_experts + 1,):
            raise ValueError(f"x must be (rows, {self.in_features}) with {self._num_experts + 1} offsets")
        out = torch.empty((source.shape[0], self.out_features), dtype=torch.float32)
        threads = torch.get_num_threads() if self._parallel else 1
        if self._call(out, source, self._weights, offsets, self._num_experts, self.out_features, self.in_features,
                      threads) != 0:
            raise MemoryError("the float32 grouped kernel could not allocate its list of experts")
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def _addresses(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """The tensors' data addresses as an int64 tensor, for a kernel that takes one pointer per expert (0: none)."""
    return torch.tensor([0 if t is None else t.data_ptr() for t in tensors], dtype=torch.int64)
