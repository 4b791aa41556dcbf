"""The linear methods: float32 unchanged, INT8/INT4 weight-only against a float64 reference, memory, errors.

The quantized kernels themselves (layout, exact integer arithmetic, the portable
build) are tested in tests/unit/test_quant_kernels.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pdserve.engine.layers import linear as linear_module
from pdserve.engine.layers.linear import (
    INT4_KERNEL_MAX_ROWS,
    INT8_AVX2_KERNEL_MAX_ROWS,
    INT8_KERNEL_MAX_ROWS,
    LM_HEAD_KERNEL_MAX_ROWS,
    NO_ROW_LIMIT,
    Int4LinearMethod,
    Int8LinearMethod,
    PackedLinear,
    linear_method,
    lm_head_method,
)
from pdserve.engine.layers.quant_kernels import unpack_int8
from pdserve.engine.types.config import ModelConfig

# Row counts on both sides of the kernel/dequantize dispatch, decode and prefill sizes.
ROWS = tuple(sorted({1, 5, 8, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, INT4_KERNEL_MAX_ROWS, INT4_KERNEL_MAX_ROWS + 1, 256}))
# The shapes of the tiny test checkpoints' q/k/v and down projections, the default model's gate/up,
# and odd ones: output rows not a multiple of the kernels' 16, inputs not a multiple of 32 (INT8 only).
SHAPES = [(64, [64, 32, 32]), (160, [64]), (576, [1536, 1536]), (96, [40, 3])]
INT8_ONLY_SHAPES = [(72, [24])]


def _linears(in_features: int, outs: list[int], bias: bool, dtype: torch.dtype) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(in_features, out, bias=bias).to(dtype) for out in outs]


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="needs oneDNN bf16 on this CPU")
def test_the_bf16_method_is_f_linear_bit_for_bit_through_a_prepacked_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where pdserve's dense kernel does not serve (AMX, or no AVX512-BF16); tests/unit/test_dense_kernels.py covers it.
    monkeypatch.setattr(linear_module, "_dense_kernels", lambda dtype: None)
    linears = _linears(576, [1536, 1536], True, torch.bfloat16)
    packed = PackedLinear(linears)
    assert packed._onednn_weight is not None and packed._mkl_weight is None
    weight = torch.cat([l.weight.detach() for l in linears])
    bias = torch.cat([l.bias.detach() for l in linears])
    with torch.inference_mode():
        for rows in (1, 7, 32, 33, 300, 2048):
            x = torch.randn(rows, 576, dtype=torch.bfloat16)
            assert torch.equal(packed(x), nn.functional.linear(x, weight, bias)), f"{rows} rows"


def test_the_float32_method_is_the_mkl_packed_gemm_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    # What PackedLinear computed before the seam existed, called directly, where pdserve's dense kernel does
    # not serve (Intel CPUs; tests/unit/test_dense_kernels.py covers the kernel).
    monkeypatch.setattr(linear_module, "_dense_kernels", lambda dtype: None)
    linears = _linears(576, [576, 192, 192], True, torch.float32)
    packed = PackedLinear(linears)
    weight = torch.cat([l.weight.detach() for l in linears])
    bias = torch.cat([l.bias.detach() for l in linears])
    reordered = torch.ops.mkl._mkl_reorder_linear_weight(weight, 32)
    with torch.inference_mode():
        for rows in (1, 7, 32, 300):
            x = torch.randn(rows, 576)
            assert torch.equal(packed(x), torch.ops.mkl._mkl_linear(x, reordered, weight, bias, rows))


@pytest.mark.parametrize(("in_features", "outs"), SHAPES + INT8_ONLY_SHAPES)
def test_int8_weights_are_within_half_a_step_of_the_checkpoints(in_features: int, outs: list[int]) -> None:
    linears = _linears(in_features, outs, False, torch.float32)
    weight = torch.cat([l.weight.detach() for l in linears])
    layer = PackedLinear(linears, Int8LinearMethod())
    q = unpack_int8(layer.qweight, weight.shape[0])
    assert layer.qweight.dtype == torch.uint8 and q.shape == (weight.shape[0], -(-in_features // 32) * 32)
    assert int(q[:, :in_features].abs().max()) == 127 and not bool(q[:, in_features:].any())
    step = weight.abs().amax(dim=1, keepdim=True) / 127  # the float32 scale, kept as is
    # Half a step of rounding, plus float32 rounding.
    assert bool(((Int8LinearMethod.dequantize(layer) - weight).abs() <= step * (0.5 + 2**-16)).all())


@pytest.mark.parametrize(("in_features", "outs"), SHAPES)
def test_int4_weights_are_within_half_a_step_of_the_checkpoints(in_features: int, outs: list[int]) -> None:
    linears = _linears(in_features, outs, False, torch.float32)
    weight = torch.cat([l.weight.detach() for l in linears])
    method = Int4LinearMethod(32)
    layer = PackedLinear(linears, method)
    groups = weight.view(weight.shape[0], -1, 32)
    step = ((groups.amax(dim=2) - groups.amin(dim=2)) / 15).repeat_interleave(32, dim=1)
    magnitude = groups.abs().amax(dim=2).repeat_interleave(32, dim=1)
    # Half a step of rounding (q is chosen for the float16 scale and minimum that are kept), plus
    # what the float16 scale's rounding (2**-11 relative, times q <= 15) can push a clamped q off.
    bound = step * (0.5 + 16 * 2**-11) + magnitude * 2**-11
    assert bool(((method.dequantize(layer) - weight).abs() <= bound).all())


def _activation_steps(x: torch.Tensor) -> torch.Tensor:
    """Half the kernels' int8 step of each activation element: max |x| / 254 over its block of 32 columns."""
    rows, columns = x.shape
    padded = nn.functional.pad(x.to(torch.float64), (0, -columns % 32)).view(rows, -1, 32)
    return (padded.abs().amax(dim=2, keepdim=True) / 254).expand(-1, -1, 32).reshape(rows, -1)[:, :columns]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("in_features", "outs", "method_name"),
    # INT4 groups of 32 must divide in_features: the INT8-only shapes do not.
    [(*shape, "int8") for shape in SHAPES + INT8_ONLY_SHAPES] + [(*shape, "int4") for shape in SHAPES],
)
@pytest.mark.parametrize("cut_off", [None, 256], ids=["default_cut_off", "cut_off_256"])
def test_quantized_methods_match_a_float64_product_at_every_dispatched_row_count(
    in_features: int, outs: list[int], method_name: str, dtype: torch.dtype, cut_off: int | None
) -> None:
    # The default cut-off (every row count on the kernel where the CPU has VNNI and no AMX) and the
    # 256 rows of other CPUs, which sends prefill-sized batches through the dequantized GEMM.
    linears = _linears(in_features, outs, True, dtype)
    method = Int8LinearMethod(cut_off) if method_name == "int8" else Int4LinearMethod(32, cut_off)
    layer = PackedLinear(linears, method)
    assert layer._quant_kernels is not None, "the CPU kernels build on this machine"
    weight = method.dequantize(layer).to(torch.float64)  # what the method multiplies by
    bias = layer.bias.to(torch.float64)
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, in_features, dtype=dtype)
            out = layer(x)
            assert out.dtype == dtype and out.shape == (rows, sum(outs))
            x64 = x.to(torch.float64)
            expected = x64 @ weight.t() + bias
            # Up to kernel_max_rows the kernel quantizes the activation to int8 per block of 32
            # (half a step per element) and sums in float32; above it bf16 activations and a bf16
            # weight round to 2**-9 relative each. The output rounds once more in bf16.
            if rows <= method.kernel_max_rows:
                bound = (_activation_steps(x) * (1 + 2**-10)) @ weight.abs().t() + (x64.abs() @ weight.abs().t()) * 2**-18
            else:
                bound = (x64.abs() @ weight.abs().t()) * 2**-7
            bound += expected.abs() * (2**-8 if dtype == torch.bfloat16 else 2**-22) + 1e-6
            assert bool(((out.to(torch.float64) - expected).abs() <= bound).all()), f"{rows} rows"


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("method_name", ["int8", "int4"])
def test_prefill_sized_batches_dequantize_to_bf16_only_where_the_cpu_has_bf16_units(
    monkeypatch: pytest.MonkeyPatch, method_name: str, native_bf16: bool
) -> None:
    # Without bf16 units oneDNN emulates bf16 products at several times float32's cost, so the
    # dequantized GEMM runs in float32 there, for float32 and bf16 activations alike.
    import pdserve.engine.layers.linear as linear

    monkeypatch.setattr(linear, "cpu_has_native_bf16", lambda: native_bf16)
    for dtype in (torch.float32, torch.bfloat16):
        linears = _linears(64, [64, 32], True, dtype)
        method = Int8LinearMethod(INT8_KERNEL_MAX_ROWS) if method_name == "int8" else Int4LinearMethod(32, INT4_KERNEL_MAX_ROWS)
        layer = PackedLinear(linears, method)
        with torch.inference_mode():
            x = torch.randn(method.kernel_max_rows + 1, 64, dtype=dtype)
            if native_bf16:
                product = nn.functional.linear(x.bfloat16(), method._dequantize(layer, torch.bfloat16))
            else:
                product = nn.functional.linear(x.float(), method._dequantize(layer, torch.float32))
            assert torch.equal(layer(x), product.to(dtype) + layer.bias), dtype


@pytest.mark.parametrize(
    ("flags", "int8_rows", "int4_rows"),
    [
        ({"avx512f", "avx512_vnni"}, NO_ROW_LIMIT, NO_ROW_LIMIT),  # Zen 4, Cooper Lake: the kernels win at every size
        # AMX tiles run the dequantized bf16 GEMM
        ({"avx512f", "avx512_vnni", "amx_bf16", "amx_int8"}, INT8_KERNEL_MAX_ROWS, INT4_KERNEL_MAX_ROWS),
        # no VNNI, no bf16 units: dequantizing means float32, which INT4's kernel beats at every size
        ({"avx2", "fma"}, INT8_AVX2_KERNEL_MAX_ROWS, NO_ROW_LIMIT),
    ],
)
def test_the_kernels_row_cut_off_follows_the_cpu(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], int8_rows: int, int4_rows: int
) -> None:
    monkeypatch.setattr(linear_module, "dispatch_flags", lambda: frozenset(flags))
    assert Int8LinearMethod().kernel_max_rows == int8_rows
    assert Int4LinearMethod(32).kernel_max_rows == int4_rows
    assert Int8LinearMethod(64).kernel_max_rows == 64  # an explicit cut-off is kept
    assert lm_head_method("int4").kernel_max_rows == LM_HEAD_KERNEL_MAX_ROWS


def test_the_lm_head_is_int8_under_quantization_unless_asked_otherwise() -> None:
    head = _linears(64, [200], False, torch.bfloat16)
    assert isinstance(lm_head_method("int4"), Int8LinearMethod)
    assert isinstance(lm_head_method("int8"), Int8LinearMethod)
    assert isinstance(PackedLinear(head, lm_head_method("int4")).method, Int8LinearMethod)
    assert not isinstance(lm_head_method("int4", quantize_lm_head=False), Int8LinearMethod)
    assert not isinstance(lm_head_method(None), Int8LinearMethod)
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'int4', got 'fp8'"):
        lm_head_method("fp8")


def test_weight_memory_of_each_method_in_bytes() -> None:
    linears = _linears(576, [1536, 1536], True, torch.float32)  # 3,072 x 576 and a bias
    out_features, in_features = 3072, 576
    bias_bytes = out_features * 4
    int8 = PackedLinear(linears, Int8LinearMethod())
    # int8 values and one float32 scale per output channel.
    assert int8.weight_bytes() == out_features * in_features + out_features * 4 + bias_bytes
    int4 = PackedLinear(linears, Int4LinearMethod(64))
    # Two values a byte, and a float16 scale and minimum per 64 inputs of each output channel.
    assert int4.weight_bytes() == out_features * in_features // 2 + (in_features // 64) * out_features * 2 * 2 + bias_bytes
    bf16 = PackedLinear([l.to(torch.bfloat16) for l in linears])
    # The weight and its oneDNN prepacked copy (where the CPU has bf16), or pdserve's bf16 kernel's panels
    # alone (AVX512-BF16 without AMX), and the bias.
    copies = 2 if bf16._onednn_weight is not None else 1
    assert bf16.weight_bytes() == copies * out_features * in_features * 2 + out_features * 2
    assert not hasattr(int8, "weight") and not hasattr(int4, "weight"), "the float weight is not kept"


def test_settings_the_checkpoint_cannot_serve_raise_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int3")
    with pytest.raises(ValueError, match=r"quantization_group_size must be one of \(32, 64, 128, 256\), got 48"):
        ModelConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="quantization_group_size=64 cannot serve a projection with in_features=160"):
        PackedLinear(_linears(160, [64], False, torch.float32), Int4LinearMethod(64))
    huge = _linears(64, [16], False, torch.float32)
    huge[0].weight.data[0, :32] = torch.linspace(0, 2e6, 32)
    with pytest.raises(ValueError, match="keeps each group's scale in float16; .* magnitude 1.33e"):
        PackedLinear(huge, Int4LinearMethod(32))
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'int4', got 'fp8'"):
        linear_method("fp8", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_private_library_gemms_give_f_linears_tokens(
    dtype: torch.dtype, llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MKL's packed sgemm (float32) and oneDNN's prepacked bf16 GEMM are private aten ops, kept where they are
    # faster (benchmarks/linear_methods.py); without them (another torch) F.linear serves, with the same tokens.
    from pdserve.engine import LLM, SamplingParams

    monkeypatch.setattr(linear_module, "_dense_kernels", lambda dtype: None)  # the library's GEMMs, not pdserve's
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)

    def tokens() -> tuple[list[list[int]], bool]:
        llm = LLM(model=str(llama_checkpoint), dtype=str(dtype).removeprefix("torch."), num_kv_blocks=32)
        layer = llm.engine.model.model.layers[0].self_attn.qkv_proj
        private = layer._mkl_weight is not None or layer._onednn_weight is not None
        return [output.token_ids for output in llm.generate(prompts, greedy)], private

    private_tokens, used = tokens()
    if not used:
        pytest.skip(f"no private library GEMM serves {dtype} on this CPU")
    monkeypatch.setattr(linear_module, "_mkl_packed", lambda weight: None)
    monkeypatch.setattr(linear_module, "_onednn_packed", lambda weight: None)
    public_tokens, used = tokens()
    assert not used and public_tokens == private_tokens
