"""PackedLinear: fused projections compute what the separate nn.Linear layers do, on CPU float32 through MKL's packed
GEMM and through pdserve's dense kernel (pdserve/engine/layers/dense_kernels.py; each path pinned here, whichever this CPU
would pick)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.layers import linear as linear_module
from pdserve.engine.layers.dense_kernels import load_dense_kernels
from pdserve.engine.models.llama import PackedLinear


@pytest.fixture(params=["library", "dense"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    kernels = load_dense_kernels() if request.param == "dense" else None
    monkeypatch.setattr(linear_module, "_dense_kernels", lambda dtype: kernels)
    return request.param


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "_dense_kernels", lambda dtype: None)


@pytest.mark.parametrize(
    ("in_features", "outs", "bias"),
    [(576, [576, 192, 192], False), (576, [1536, 1536], False), (1536, [576], False), (64, [48, 16, 16], True)],
)
def test_packed_linear_equals_the_separate_layers_at_every_batch_size(
    in_features: int, outs: list[int], bias: bool, path: str
) -> None:
    torch.manual_seed(0)
    linears = [nn.Linear(in_features, out, bias=bias) for out in outs]
    packed = PackedLinear(linears)
    if path == "library":
        assert packed._mkl_weight is not None, "CPU float32 with MKL takes the packed GEMM"
    else:
        assert packed._dense_gemm is not None and packed._mkl_weight is None
    with torch.inference_mode():
        # One packed copy serves decode batches of any size and prefill chunks alike.
        for num_tokens in (1, 2, 3, 7, 8, 31, 32, 33, 100, 2048):
            x = torch.randn(num_tokens, in_features)
            expected = torch.cat([linear(x) for linear in linears], dim=1)
            out = packed(x)
            assert out.shape == (num_tokens, sum(outs))
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_missing_bias_among_biased_layers_is_zero(path: str) -> None:
    torch.manual_seed(1)
    with_bias, without = nn.Linear(8, 4, bias=True), nn.Linear(8, 2, bias=False)
    packed = PackedLinear([with_bias, without])
    assert packed.bias is not None
    assert torch.equal(packed.bias[4:], torch.zeros(2))
    x = torch.randn(16, 8)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), torch.cat([with_bias(x), without(x)], dim=1), rtol=1e-5, atol=1e-6)


def test_half_precision_keeps_f_linear(library: None) -> None:
    torch.manual_seed(2)
    linears = [nn.Linear(32, 16).to(torch.bfloat16), nn.Linear(32, 8).to(torch.bfloat16)]
    packed = PackedLinear(linears)
    assert packed._mkl_weight is None
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = nn.functional.linear(x, torch.cat([l.weight for l in linears]), torch.cat([l.bias for l in linears]))
        assert torch.equal(packed(x), expected)


def test_a_single_layer_shares_its_weight_tensor(library: None) -> None:
    # A tied LM head must stay the embedding's storage, not a second copy of the largest matrix.
    embedding = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = embedding.weight
    assert PackedLinear([head]).weight.data_ptr() == embedding.weight.data_ptr()
