"""pdserve's dense GEMMs (pdserve/engine/kernels/dense_gemm.c) against a float64 reference, in every variant this CPU runs.

Each output is one float32 sum over the input columns: float32 results lie
within the float32 accumulation bound of the exact product (k * 2^-24 of the
sum of the products' magnitudes, doubled for the final bias add); bf16 results,
rounded once, must be one of the two bf16 values next to the exact result
(a faithful rounding) up to that bound.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.layers import linear as linear_module
from pdserve.engine.layers.dense_kernels import PANEL, dense_kernel_serves_this_cpu, load_dense_kernels, pack_dense, unpack_dense
from pdserve.engine.layers.linear import PackedLinear
from pdserve.engine.native import cpu_flags, cpu_vendor
from tests.support.cpu_paths import variant_params

# Every variant's code paths (float32, bf16), for the variants this CPU runs.
_PATHS = {
    "portable": {torch.float32: "portable", torch.bfloat16: "portable"},
    "avx2": {torch.float32: "avx2", torch.bfloat16: "portable"},
    "avx512": {torch.float32: "avx512", torch.bfloat16: "portable"},
    "avx512_vnni": {torch.float32: "avx512", torch.bfloat16: "portable"},
    "avx512_bf16": {torch.float32: "avx512", torch.bfloat16: "avx512_bf16"},
}
BUILDS = variant_params(values=lambda variant: (variant, _PATHS[variant]))
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]
# Output counts that fill panels, leave the last one partial, or are smaller than one; inputs down to one pair.
SHAPES = [(576, 960), (64, 40), (1536, 576), (6, 3), (2, 33)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 17, 32, 33, 65, 130]


def assert_within_rounding(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = x.double() @ weight.double().T
    if bias is not None:
        exact += bias.double()
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = 2 * (x.shape[1] + 1) * 2.0**-24 * magnitude
    if out.dtype == torch.bfloat16:
        # One bf16 step at |exact|: 2^(exponent - 7).
        bound = bound + torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=2.0**-120))) - 7)
    error = (out.double() - exact).abs()
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max()):.3g}"


@pytest.mark.parametrize(("variant", "isa"), BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_build_computes_each_output_within_rounding(
    variant: str, isa: dict, dtype: torch.dtype, in_features: int, out_features: int, with_bias: bool
) -> None:
    kernels = load_dense_kernels(variant)
    assert kernels is not None and kernels.isa == isa
    torch.manual_seed(in_features + out_features)
    weight = (torch.randn(out_features, in_features) * 0.1).to(dtype)
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    gemm = kernels.bind(pack_dense(weight), bias, out_features)
    for rows in ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        out = gemm(x)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        assert_within_rounding(out, x, weight, bias)


@pytest.mark.parametrize(("variant", "isa"), BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_independent_of_the_batch_and_of_the_thread_count(variant: str, isa: dict, dtype: torch.dtype) -> None:
    kernels = load_dense_kernels(variant)
    torch.manual_seed(1)
    weight = torch.randn(3072, 576).to(dtype)  # above the one-thread cut-off: split over panels
    gemm = kernels.bind(pack_dense(weight), None, 3072)
    x = torch.randn(70, 576).to(dtype)  # two blocks of rows
    together = gemm(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = gemm(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    # A row's result does not depend on the rows beside it (row groups, blocks of 64 rows).
    for row in (0, 1, 7, 8, 63, 64, 69):
        assert torch.equal(gemm(x[row : row + 1].contiguous()), together[row : row + 1]), f"row {row}"


def test_pack_lays_out_panels_of_32_outputs() -> None:
    weight = torch.arange(40 * 6, dtype=torch.float32).view(40, 6)
    bf16 = pack_dense(weight.to(torch.bfloat16))
    assert bf16.shape == (2, 3, PANEL, 2)
    # Panel 1, pair 2, row 3 of the panel: output row 35, columns 4 and 5.
    assert bf16[1, 2, 3].tolist() == [35 * 6 + 4, 35 * 6 + 5]
    assert bool((bf16[1, :, 8:] == 0).all()), "rows past the last output are zero"
    assert torch.equal(unpack_dense(bf16, 40), weight.to(torch.bfloat16))
    f32 = pack_dense(weight)
    assert f32.shape == (2, 6, PANEL)
    assert f32[1, 4, 3].item() == 35 * 6 + 4 and bool((f32[1, :, 8:] == 0).all())
    assert torch.equal(unpack_dense(f32, 40), weight)
    with pytest.raises(ValueError, match="in_features must be even, got 5"):
        pack_dense(torch.zeros(4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16 weights, got torch.float16"):
        pack_dense(torch.zeros(4, 6, dtype=torch.float16))


def test_bad_arguments_raise_value_errors() -> None:
    kernels = load_dense_kernels("portable")
    panels = pack_dense(torch.zeros(40, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="panels must be contiguous CPU float32"):
        kernels.bind(panels, None, 70)
    with pytest.raises(ValueError, match=r"bias must be contiguous torch.bfloat16 of shape \(40,\)"):
        kernels.bind(panels, torch.zeros(40), 40)
    gemm = kernels.bind(panels, None, 40)
    with pytest.raises(ValueError, match="x must be a contiguous CPU torch.bfloat16 tensor"):
        gemm(torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"x must be \(rows, 8\), got \(2, 6\)"):
        gemm(torch.zeros(2, 6, dtype=torch.bfloat16))
    assert gemm(torch.zeros(0, 8, dtype=torch.bfloat16)).shape == (0, 40)


def test_the_kernels_serve_where_they_were_measured_faster() -> None:
    flags = cpu_flags()
    assert dense_kernel_serves_this_cpu(torch.bfloat16) == ("avx512_bf16" in flags and "amx_bf16" not in flags)
    assert dense_kernel_serves_this_cpu(torch.float32) == (cpu_vendor() == "AuthenticAMD" and "avx512f" in flags)
    assert not dense_kernel_serves_this_cpu(torch.float16)


@pytest.fixture
def dense_kernels_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unquantized layers on the kernels of this CPU's best variant (portable bf16 where it lacks AVX512-BF16)."""
    kernels = load_dense_kernels()
    assert kernels is not None
    monkeypatch.setattr(linear_module, "_dense_kernels", lambda dtype: kernels)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_keeps_only_the_kernels_panels_and_runs_every_row_count_on_them(
    dense_kernels_here: None, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    linears = [nn.Linear(576, out, bias=True).to(dtype) for out in (64, 32, 16)]
    packed = PackedLinear(linears)
    assert packed._dense_gemm is not None and packed._onednn_weight is None and packed._mkl_weight is None
    assert not hasattr(packed, "weight"), "the weight is kept once, in the panels"
    weight = torch.cat([l.weight.detach() for l in linears])
    bias = torch.cat([l.bias.detach() for l in linears])
    assert torch.equal(unpack_dense(packed._dense_gemm.panels, 112), weight)
    with torch.inference_mode():
        for rows in (1, 5, 32, 65, 300):
            x = torch.randn(rows, 576).to(dtype)
            out = packed(x)
            assert out.shape == (rows, 112) and out.dtype == dtype
            assert_within_rounding(out, x, weight, bias)
        # A non-contiguous activation (a column slice) reads as its contiguous copy.
        wide = torch.randn(3, 600).to(dtype)
        assert torch.equal(packed(wide[:, :576]), packed(wide[:, :576].contiguous()))
    # The panels (112 outputs padded to 128) and the bias.
    size = weight.element_size()
    assert packed.weight_bytes() == 128 * 576 * size + 112 * size


def test_odd_bf16_widths_and_half_precision_stay_off_the_kernels(dense_kernels_here: None) -> None:
    assert PackedLinear([nn.Linear(63, 32).to(torch.bfloat16)])._dense_gemm is None
    assert PackedLinear([nn.Linear(64, 32).to(torch.float16)])._dense_gemm is None
    assert PackedLinear([nn.Linear(63, 32)])._dense_gemm is not None  # float32 reads one column at a time
