"""The fused C norm and activation against the torch ops they replace, and where the model uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.layers import fused_ops
from pdserve.engine.layers.fused_ops import FusedOps, load_fused_ops
from pdserve.engine.native import load_kernel_ops
from tests.support.cpu_paths import variant_params


def _ops(variant: str | None = None) -> FusedOps:
    kernels = load_kernel_ops(variant)
    assert kernels is not None, "pdserve was installed without its kernels (PDSERVE_BUILD_KERNELS=0?)"
    return FusedOps(kernels)


def _torch_add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    summed = residual + delta
    x32 = summed.to(torch.float32)
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(summed.dtype)
    return summed, normed


# Widths: the default model's hidden size, the test checkpoints', and one with a tail past 16 lanes.
SHAPES = [(32, 576), (3, 64), (5, 24), (1, 7)]


@pytest.mark.parametrize(("rows", "width"), SHAPES)
def test_bf16_add_rms_norm_equals_torch_on_these_inputs(rows: int, width: int) -> None:
    torch.manual_seed(0)
    residual = (torch.randn(rows, width) * 3).bfloat16()
    delta = torch.randn(rows, width).bfloat16()
    weight = (torch.rand(width) + 0.5).bfloat16()
    expected_sum, expected = _torch_add_rms_norm(residual, delta, weight, 1e-5)

    out = _ops().rms_norm(residual, weight, 1e-5, delta)

    assert torch.equal(residual, expected_sum)  # updated in place, rounded as torch's add rounds
    # The sum of squares adds in another order: at most one bf16 step, and on these inputs none.
    assert torch.equal(out, expected)


@pytest.mark.parametrize(("rows", "width"), SHAPES)
def test_bf16_silu_mul_equals_torch_on_these_inputs(rows: int, width: int) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(rows, 2 * width) * 4).bfloat16()
    gate_up[0, 0] = 0.0
    gate_up[-1, 0] = -30.0  # exp underflow side

    out = _ops().silu_mul(gate_up)

    assert torch.equal(out, F.silu(gate_up[:, :width]).mul_(gate_up[:, width:]))


def test_float32_results_are_within_float32_rounding_of_torch() -> None:
    # Not used for float32 models (the oracle keeps torch's own op order), but computed correctly.
    torch.manual_seed(2)
    residual, delta, weight = torch.randn(8, 576) * 3, torch.randn(8, 576), torch.rand(576) + 0.5
    expected_sum, expected = _torch_add_rms_norm(residual, delta, weight, 1e-6)
    out = _ops().rms_norm(residual, weight, 1e-6, delta)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(out, expected, rtol=4e-7, atol=0)
    gate_up = torch.randn(8, 3072) * 4
    torch.testing.assert_close(_ops().silu_mul(gate_up), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:], rtol=1e-6, atol=0)


def test_rms_norm_without_delta_leaves_the_residual_alone() -> None:
    residual = torch.randn(4, 64).bfloat16()
    before = residual.clone()
    weight = torch.ones(64).bfloat16()
    out = _ops().rms_norm(residual, weight, 1e-5)
    x32 = before.float()
    assert torch.equal(residual, before)
    assert torch.equal(out, weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16())


def test_bad_tensors_are_refused_with_the_argument_named() -> None:
    ops = _ops()
    with pytest.raises(ValueError, match="residual must be a contiguous"):
        ops.rms_norm(torch.randn(4, 8).bfloat16().t(), torch.ones(4).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="weight must be torch.bfloat16"):
        ops.rms_norm(torch.randn(4, 8).bfloat16(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="delta .* must have the residual's shape"):
        ops.rms_norm(torch.randn(4, 8).bfloat16(), torch.ones(8).bfloat16(), 1e-5, torch.randn(2, 8).bfloat16())
    with pytest.raises(ValueError, match="gate_up must be a contiguous"):
        ops.silu_mul(torch.randn(4, 8).half())


def test_the_model_uses_them_on_cpu_in_bf16_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_fused_ops(torch.device("cpu"), torch.bfloat16) is not None
    # float32 stays on torch's ops (the exactness oracle), as do float16 and GPUs.
    assert load_fused_ops(torch.device("cpu"), torch.float32) is None
    assert load_fused_ops(torch.device("cpu"), torch.float16) is None
    assert load_fused_ops(torch.device("cuda"), torch.bfloat16) is None
    # A package built without its kernels has none, and the model keeps torch's ops.
    monkeypatch.setattr(fused_ops, "load_kernel_ops", lambda variant=None: None)
    assert load_fused_ops(torch.device("cpu"), torch.bfloat16) is None


@pytest.mark.parametrize("variant", variant_params())
def test_every_variant_gives_the_portable_ones_bits(variant: str) -> None:
    torch.manual_seed(11)
    portable, ops = _ops("portable"), _ops(variant)
    for dtype in (torch.float32, torch.bfloat16):
        residual, delta = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype)
        weight = torch.randn(576).to(dtype)
        results = []
        for kernels in (portable, ops):
            summed = residual.clone()
            results.append((kernels.rms_norm(summed, weight, 1e-5, delta), summed))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
        gate_up = torch.randn(5, 2 * 1536).to(dtype)
        assert torch.equal(portable.silu_mul(gate_up), ops.silu_mul(gate_up))
