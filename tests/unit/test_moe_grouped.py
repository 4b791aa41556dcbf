"""A mixture-of-experts layer's experts (quantized, or float32 in the dense kernel's panels) in one kernel call:
the bits of one call per expert."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.layers.dense_kernels import load_dense_kernels
from pdserve.engine.layers.linear import (
    GroupedDenseGemm,
    GroupedQuantizedGemm,
    Int4LinearMethod,
    Int8LinearMethod,
    PackedLinear,
    UnquantizedLinearMethod,
)
from pdserve.engine.layers.quant_kernels import load_quant_kernels
from pdserve.engine.native import supported_variants
from tests.support.cpu_paths import variant_params

# Expert row counts: an expert with no rows, one with one, one past the 16 rows from which the per-expert
# INT8 kernel takes its tiles in pairs.
COUNTS = [3, 0, 7, 1, 20]


def _experts(method_name: str, variant: str, seed: int) -> list[PackedLinear]:
    torch.manual_seed(seed)
    experts = []
    for _ in COUNTS:
        linear = nn.Linear(64, 80, bias=False)  # 80 outputs: the last tile of 16 is padded
        method = Int8LinearMethod() if method_name == "int8" else Int4LinearMethod(32)
        layer = PackedLinear([linear], method)
        layer._quant_kernels = load_quant_kernels(variant)
        experts.append(layer)
    return experts


@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("method_name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_grouped_call_gives_each_experts_own_bits(variant: str, method_name: str, dtype: torch.dtype) -> None:
    experts = _experts(method_name, variant, seed=len(variant))
    assert GroupedQuantizedGemm.serves(experts)
    grouped = GroupedQuantizedGemm(experts)
    x = torch.randn(sum(COUNTS), 64).to(dtype)
    offsets = torch.tensor([0, 3, 3, 10, 11, 31], dtype=torch.int64)
    expected = torch.cat([expert(x[offsets[e] : offsets[e + 1]]) for e, expert in enumerate(experts)])
    got = grouped(x, offsets)
    assert got.dtype == dtype and got.shape == (31, 80)
    assert torch.equal(got, expected)
    # Only the experts with rows share out the work: empty ones first and last, and none at all.
    for ends in ([0, 0, 9, 9], [0, 0, 0, 0]):
        offsets = torch.tensor([0, *ends, ends[-1]], dtype=torch.int64)
        rows = x[: ends[-1]]
        expected = torch.cat([expert(rows[offsets[e] : offsets[e + 1]]) for e, expert in enumerate(experts)])
        assert torch.equal(grouped(rows, offsets), expected)


def test_layers_of_mixed_methods_shapes_or_biases_are_not_grouped() -> None:
    experts = _experts("int8", supported_variants()[-1], seed=0)
    other = _experts("int4", supported_variants()[-1], seed=1)
    assert not GroupedQuantizedGemm.serves([experts[0], other[0]])
    wide = PackedLinear([nn.Linear(64, 96, bias=False)], Int8LinearMethod())
    assert not GroupedQuantizedGemm.serves([experts[0], wide])
    biased = PackedLinear([nn.Linear(64, 80, bias=True)], Int8LinearMethod())
    assert not GroupedQuantizedGemm.serves([biased, experts[0]])
    assert not GroupedQuantizedGemm.serves([PackedLinear([nn.Linear(64, 80, bias=False)])])  # unquantized


def _float32_experts(variant: str, monkeypatch: pytest.MonkeyPatch) -> list[PackedLinear]:
    from pdserve.engine.layers import linear

    kernels = load_dense_kernels(variant)
    # Float32 in the dense kernel's panels (the engine's choice on AMD CPUs with AVX-512), from this variant.
    monkeypatch.setattr(linear, "_dense_kernels", lambda dtype: kernels if dtype == torch.float32 else None)
    torch.manual_seed(len(variant))
    return [PackedLinear([nn.Linear(64, 80, bias=False)], UnquantizedLinearMethod()) for _ in COUNTS]


@pytest.mark.parametrize("variant", variant_params())
def test_one_grouped_float32_call_gives_each_experts_own_bits(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    experts = _float32_experts(variant, monkeypatch)
    # Each expert keeps its weight only in panels (80 outputs: the last panel of 32 is padded).
    assert all(expert._dense_gemm is not None and not hasattr(expert, "weight") for expert in experts)
    assert GroupedDenseGemm.serves(experts) and not GroupedQuantizedGemm.serves(experts)
    grouped = GroupedDenseGemm(experts)
    x = torch.randn(sum(COUNTS), 64)
    offsets = torch.tensor([0, 3, 3, 10, 11, 31], dtype=torch.int64)
    expected = torch.cat([expert(x[offsets[e] : offsets[e + 1]]) for e, expert in enumerate(experts)])
    got = grouped(x, offsets)
    assert got.dtype == torch.float32 and got.shape == (31, 80)
    assert torch.equal(got, expected)
    # bf16 rows are multiplied in float32 and rounded once, as each expert's own call does.
    rows = x.to(torch.bfloat16)
    assert torch.equal(grouped(rows, offsets), torch.cat(
        [expert(rows[offsets[e] : offsets[e + 1]]) for e, expert in enumerate(experts)]))


def test_float32_experts_without_panels_or_with_biases_are_not_grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.engine.layers import linear

    experts = _float32_experts(supported_variants()[-1], monkeypatch)
    biased = PackedLinear([nn.Linear(64, 80, bias=True)], UnquantizedLinearMethod())
    assert not GroupedDenseGemm.serves([experts[0], biased])
    wide = PackedLinear([nn.Linear(64, 96, bias=False)], UnquantizedLinearMethod())
    assert not GroupedDenseGemm.serves([experts[0], wide])
    monkeypatch.setattr(linear, "_dense_kernels", lambda dtype: None)
    plain = PackedLinear([nn.Linear(64, 80, bias=False)])  # the library's GEMM: no panels
    assert plain._dense_gemm is None and not GroupedDenseGemm.serves([experts[0], plain])


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_a_moe_layer_gives_the_same_bits_grouped_and_expert_by_expert(
    qwen3_moe_checkpoint, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.engine.layers import linear
    from pdserve.engine.model_loader import load_hf_config, load_model
    from pdserve.engine.models.llama import MoE

    if quantization is None:
        # Float32 weights in the dense kernel's panels, as the engine keeps them on AMD CPUs with AVX-512.
        kernels = load_dense_kernels()
        monkeypatch.setattr(linear, "_dense_kernels", lambda dtype: kernels if dtype == torch.float32 else None)
    path = qwen3_moe_checkpoint
    model = load_model(path, load_hf_config(path), 256, torch.float32, torch.device("cpu"), quantization, 32)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, MoE) and moe.grouped is not None
    x = torch.randn(12, 64)
    grouped, grouped_one = moe(x), moe(x[:1])  # 12 tokens, and one (a batch-1 decode step)
    moe.grouped = None  # one call per expert
    assert torch.equal(moe(x), grouped)
    assert torch.equal(moe(x[:1]), grouped_one)
