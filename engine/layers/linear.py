"""How a projection stores its weights and multiplies: one ``LinearMethod`` per precision or quantization.

``PackedLinear`` is the projection the model calls (``self.qkv_proj(x)``): the
loaded ``nn.Linear`` layers that read the same input, fused into one
(sum of out_features, in_features) matrix. What happens to that matrix after
loading, and how a forward multiplies by it, belongs to its ``LinearMethod``
(vLLM's ``LinearMethodBase`` shape: process the weights once after loading,
then ``apply``):

- ``UnquantizedLinearMethod``: the checkpoint's floats in the model dtype.
  On CPU in float32 the matrix is also kept in MKL's packed GEMM format; in
  bf16/fp16 it is ``F.linear`` (oneDNN, on the AMX tile units where the CPU
  has them; BENCHMARKS.md, issue 11).
- ``Int8LinearMethod``: weight-only INT8, one symmetric scale per output channel.
- ``Int4LinearMethod``: weight-only INT4, asymmetric, one scale and zero per
  ``group_size`` input columns of each output channel.

The quantized methods dispatch by row count: up to ``kernel_max_rows`` rows
(decode batches) aten's weight-only kernels read the small weights directly,
with bf16 activations whatever the model dtype; above it the weights are
dequantized to bf16 for this call only and
multiplied on the matrix units (no dequantized copy is kept, so the memory
saving holds).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from engine.config import INT4_GROUP_SIZES

# A typical decode batch; see _mkl_packed.
_MKL_PACK_BATCH_SIZE = 32
# Above these many rows the quantized methods dequantize to bf16 and use the
# matrix units; at or below them aten's weight-only kernels win (the crossovers
# measured at 1-2,048 rows: BENCHMARKS.md, issue 11).
INT8_KERNEL_MAX_ROWS = 32
INT4_KERNEL_MAX_ROWS = 64
# The quantized methods' activations, scales and dequantized weights: bf16 runs
# on the AMX/AVX512-BF16 units (6.5x float32 at 2,048 rows, issue 11), and
# aten's int kernels with float32 activations are 10-100x slower than with bf16
# at 8 rows and up (BENCHMARKS.md, issue 11).
_GEMM_DTYPE = torch.bfloat16
# aten's CPU int4 packing: its inner_k_tiles argument, and the output rows it packs together.
_INT4_INNER_K_TILES = 2
_INT4_PACK_ROWS = 64


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

    On CPU: float32 as an MKL packed GEMM; bf16 as a oneDNN prepacked GEMM
    (bit for bit ``F.linear``'s result, about 20% faster at 1-256 rows,
    BENCHMARKS.md issue 11). ``F.linear`` elsewhere.
    """

    def process_weights_after_loading(self, layer: PackedLinear) -> None:
        layer._mkl_weight = _mkl_packed(layer.weight)
        layer._onednn_weight = _onednn_packed(layer.weight)

    def apply(self, layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        if layer._onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer._onednn_weight, layer.bias, "none", [], "")
        if layer._mkl_weight is None:
            return nn.functional.linear(x, layer.weight, layer.bias)
        # The last argument names the batch size the packed weight serves; the
        # op falls back to F.linear for any other, so it is always this batch's.
        return torch.ops.mkl._mkl_linear(x, layer._mkl_weight, layer.weight, layer.bias, x.shape[0])


class Int8LinearMethod(LinearMethod):
    """Weight-only INT8: ``W ≈ qweight * scales[:, None]``, qweight int8 in [-127, 127], one scale per output row."""

    def __init__(self, kernel_max_rows: int = INT8_KERNEL_MAX_ROWS) -> None:
        self.kernel_max_rows = kernel_max_rows

    def process_weights_after_loading(self, layer: PackedLinear) -> None:
        weight = layer.weight.detach().to(torch.float32)  # (out, in)
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # (out,)
        qweight = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        del layer.weight
        layer.register_buffer("qweight", qweight)  # (out, in) int8
        # The aten kernel wants the scales in the activations' dtype, always bf16 (see _GEMM_DTYPE).
        layer.register_buffer("scales", scales.to(_GEMM_DTYPE))  # (out,)
        layer._mkl_weight = None

    def apply(self, layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.kernel_max_rows and x.device.type == "cpu":
            out = torch._weight_int8pack_mm(x.to(_GEMM_DTYPE), layer.qweight, layer.scales).to(x.dtype)
        else:
            weight = layer.qweight.to(_GEMM_DTYPE) * layer.scales.to(_GEMM_DTYPE)[:, None]
            out = nn.functional.linear(x.to(_GEMM_DTYPE), weight).to(x.dtype)
        return out if layer.bias is None else out.add_(layer.bias)

    @staticmethod
    def dequantize(layer: PackedLinear) -> torch.Tensor:
        """The float32 weight the method multiplies by: (out, in)."""
        return layer.qweight.to(torch.float32) * layer.scales.to(torch.float32)[:, None]


class Int4LinearMethod(LinearMethod):
    """Weight-only INT4, group-wise: ``W ≈ (q - 8) * scale + zero`` per ``group_size`` input columns, q in [0, 15].

    The weights are kept in aten's CPU int4 packing (two values a byte) with
    scales and zeros as (in / group_size, out, 2) in bf16.
    """

    def __init__(self, group_size: int, kernel_max_rows: int = INT4_KERNEL_MAX_ROWS) -> None:
        self.group_size = group_size
        self.kernel_max_rows = kernel_max_rows

    def process_weights_after_loading(self, layer: PackedLinear) -> None:
        out_features, in_features = layer.weight.shape
        check_int4_group_size(in_features, self.group_size)
        if out_features % _INT4_PACK_ROWS:
            raise ValueError(
                f"quantization='int4' needs out_features divisible by {_INT4_PACK_ROWS} (aten's CPU packing), "
                f"got out_features={out_features}"
            )
        if layer.weight.device.type != "cpu":
            raise ValueError(f"quantization='int4' needs device 'cpu' (got {layer.weight.device.type})")
        weight = layer.weight.detach().to(torch.float32).view(out_features, in_features // self.group_size, self.group_size)
        low, high = weight.amin(dim=2), weight.amax(dim=2)  # (out, groups)
        scale = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
        zero = low + 8.0 * scale  # the value of q = 8
        q = torch.round((weight - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
        del layer.weight
        packed = torch._convert_weight_to_int4pack_for_cpu(q.view(out_features, in_features), _INT4_INNER_K_TILES)
        layer.register_buffer("qweight", packed)  # (out, in / 2) uint8
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1)  # (groups, out, 2)
        layer.register_buffer("scales_and_zeros", scales_and_zeros.to(_GEMM_DTYPE).contiguous())
        layer.in_features, layer.out_features = in_features, out_features
        layer._mkl_weight = None

    def apply(self, layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.kernel_max_rows:
            out = torch._weight_int4pack_mm_for_cpu(
                x.to(_GEMM_DTYPE), layer.qweight, self.group_size, layer.scales_and_zeros
            ).to(x.dtype)
        else:
            weight = self._dequantize(layer, _GEMM_DTYPE)
            out = nn.functional.linear(x.to(_GEMM_DTYPE), weight).to(x.dtype)
        return out if layer.bias is None else out.add_(layer.bias)

    def dequantize(self, layer: PackedLinear) -> torch.Tensor:
        """The float32 weight the method multiplies by: (out, in)."""
        return self._dequantize(layer, torch.float32)

    def _dequantize(self, layer: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
        out_features, in_features = layer.out_features, layer.in_features
        # aten's CPU packing: per block of 64 output rows, byte [k, j] holds row j
        # (low nibble) and row j + 32 (high nibble) of input column k.
        blocks = layer.qweight.view(out_features // _INT4_PACK_ROWS, in_features, _INT4_PACK_ROWS // 2)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).transpose(1, 2).reshape(out_features, in_features)
        groups = in_features // self.group_size
        scale = layer.scales_and_zeros[..., 0].t().to(dtype)[..., None]  # (out, groups, 1)
        offset = layer.scales_and_zeros[..., 1].t().to(dtype)[..., None] - 8.0 * scale  # the value of q = 0
        # In place on the fresh contiguous copy: two passes over the weight after the unpacking.
        weight = q.view(out_features, groups, self.group_size).to(dtype).mul_(scale).add_(offset)
        return weight.view(out_features, in_features)


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
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (num_tokens, in) -> (num_tokens, sum out)
        return self.method.apply(self, x)

    def weight_bytes(self) -> int:
        """Bytes of the tensors this layer keeps for its weight and bias (packed GEMM copies counted at their dense size)."""
        tensors = [*self.parameters(recurse=False), *self.buffers(recurse=False)]
        tensors += [t for t in (self._mkl_weight, self._onednn_weight) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def _mkl_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in MKL's packed GEMM format, or None where that does not apply (GPU, half precision, no MKL)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return None
    # The batch size is a hint for MKL's blocking; a packed matrix computes correctly for any batch size.
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, _MKL_PACK_BATCH_SIZE)


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` prepacked for oneDNN's bf16 GEMM (AMX/AVX512-BF16), or None where that does not apply."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or not torch.backends.mkldnn.is_available()
        or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return None
    # As for MKL, the batch size is a blocking hint; any batch size computes correctly.
    return torch.ops.mkldnn._reorder_linear_weight(weight, _MKL_PACK_BATCH_SIZE)


def check_int4_group_size(in_features: int, group_size: int) -> None:
    """ValueError unless ``group_size`` can quantize a projection with ``in_features`` inputs."""
    if group_size not in INT4_GROUP_SIZES or in_features % group_size:
        raise ValueError(
            f"quantization_group_size={group_size} cannot serve a projection with in_features={in_features}: "
            f"it must be one of {INT4_GROUP_SIZES} and divide in_features"
        )


def linear_method(quantization: str | None, group_size: int) -> LinearMethod:
    """The method for the model's projections (the LM head stays unquantized, as in vLLM)."""
    if quantization is None:
        return UnquantizedLinearMethod()
    if quantization == "int8":
        return Int8LinearMethod()
    if quantization == "int4":
        return Int4LinearMethod(group_size)
    raise ValueError(f"quantization must be None, 'int8' or 'int4', got {quantization!r}")
