"""The INT8/INT4 CPU kernels (pdserve/engine/kernels/quant_gemv.c) against a torch model of their integer arithmetic.

The reference quantizes the activation exactly as the kernel does (float32
``d = max|x| / 127``, ``xq = round(x * (127 / max|x|))`` half to even, per block
of 32 columns), sums the integer products exactly in int64 and scales them in
float64; the kernel may differ only by its float32 sums over the blocks.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.layers import quant_kernels as qk
from pdserve.engine.native import supported_variants
from tests.support.cpu_paths import variant_params

# The best variant this CPU runs; every test of the built kernels needs them (setup.py builds them).
KERNELS = qk.load_quant_kernels()
assert KERNELS is not None, "pdserve was installed without its kernels (PDSERVE_BUILD_KERNELS=0?)"

# (out, in): the default model's q/k/v, tiny ones, outputs not a multiple of 16, several blocks.
SHAPES = [(960, 576), (1, 32), (50, 64), (17, 96), (576, 1536)]
ROWS = [1, 2, 3, 4, 5, 9]


def _quantized_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """xq (rows, blocks, 32) int64 and d (rows, blocks, 1) float64, computed in float32 as the kernel does."""
    blocks = x.to(torch.float32).view(x.shape[0], -1, qk.QBLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(blocks * inverse).to(torch.int64), (amax / 127.0).to(torch.float64)


def _int8_case(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    scales = torch.rand(out_features) * 0.01 + 1e-4
    return q, scales


def _int8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq, d = _quantized_activation(x)
    qb = q.to(torch.int64).view(q.shape[0], -1, qk.QBLOCK)
    sums = torch.einsum("rbk,obk->rob", xq, qb).to(torch.float64)  # exact integer sums per block
    terms = sums * d.squeeze(2)[:, None, :] * scales.to(torch.float64)[None, :, None]
    return terms.sum(dim=2), terms.abs().sum(dim=2)


def _int4_case(out_features: int, in_features: int, group_size: int) -> tuple[torch.Tensor, ...]:
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    groups = in_features // group_size
    scale = (torch.rand(out_features, groups) * 0.01 + 1e-4).to(torch.float16)
    minimum = (torch.randn(out_features, groups) * 0.05).to(torch.float16)
    return q, scale, minimum


def _int4_reference(x, q, scale, minimum, group_size):  # noqa: ANN001, ANN202
    xq, d = _quantized_activation(x)
    blocks = q.shape[1] // qk.QBLOCK
    qb = q.to(torch.int64).view(q.shape[0], blocks, qk.QBLOCK)
    per_block = group_size // qk.QBLOCK
    s = scale.to(torch.float64).repeat_interleave(per_block, dim=1)  # (out, blocks)
    m = minimum.to(torch.float64).repeat_interleave(per_block, dim=1)
    sums = torch.einsum("rbk,obk->rob", xq, qb).to(torch.float64)
    d2 = d.squeeze(2)[:, None, :]  # (rows, 1, blocks)
    xsum = xq.sum(dim=2).to(torch.float64)[:, None, :]
    terms = torch.stack([sums * s[None] * d2, m[None] * d2 * xsum])
    return terms.sum(dim=(0, 3)), terms.abs().sum(dim=(0, 3))


def _check(out: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> None:
    # float32 sums over at most 48 blocks (2**-24 each), and the output's own rounding.
    rounding = 2**-8 if out.dtype == torch.bfloat16 else 2**-24
    bound = magnitude * 2**-17 + expected.abs() * rounding + 1e-30
    error = (out.to(torch.float64) - expected).abs()
    assert bool((error <= bound).all()), f"max error {float(error.max()):.3g}, bound {float(bound.min()):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int8_kernel_is_the_exact_integer_product_up_to_float32_sums(
    out_features: int, in_features: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(out_features + in_features)
    q, scales = _int8_case(out_features, in_features)
    tiles = qk.pack_int8(q)
    row_scales = torch.zeros(qk.padded(out_features, qk.TILE))
    row_scales[:out_features] = scales
    for rows in ROWS:
        x = (torch.randn(rows, in_features) * 3).to(dtype)
        out = KERNELS.int8_gemm(x, tiles, row_scales, out_features)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        _check(out, *_int8_reference(x, q, scales))


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), [s for s in SHAPES if s[1] % 64 == 0])
def test_int4_kernel_is_the_exact_integer_product_up_to_float32_sums(
    out_features: int, in_features: int, dtype: torch.dtype, group_size: int
) -> None:
    torch.manual_seed(out_features + in_features)
    q, scale, minimum = _int4_case(out_features, in_features, group_size)
    tiles, scales, minimums = qk.pack_int4(q), qk.pack_rows(scale), qk.pack_rows(minimum)
    for rows in ROWS:
        x = (torch.randn(rows, in_features) * 3).to(dtype)
        out = KERNELS.int4_gemm(x, tiles, scales, minimums, group_size, out_features)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        _check(out, *_int4_reference(x, q, scale, minimum, group_size))


def test_threads_split_the_rows_without_changing_a_bit() -> None:
    # Large enough to run on several threads (the kernel splits tiles of output rows, sums stay per row),
    # and 40 rows of 576: enough elements that the activation's quantization splits its rows too.
    torch.manual_seed(3)
    q, scale, minimum = _int4_case(3072, 576, 32)
    tiles, scales, minimums = qk.pack_int4(q), qk.pack_rows(scale), qk.pack_rows(minimum)
    x = torch.randn(40, 576, dtype=torch.bfloat16)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNELS.int4_gemm(x, tiles, scales, minimums, 32, 3072)
        torch.set_num_threads(2)
        two = KERNELS.int4_gemm(x, tiles, scales, minimums, 32, 3072)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_no_rows_give_an_empty_result() -> None:
    q, scales = _int8_case(32, 64)
    assert KERNELS.int8_gemm(torch.randn(0, 64), qk.pack_int8(q), scales, 32).shape == (0, 32)


def test_a_zero_activation_block_gives_exact_zeros_and_no_nan() -> None:
    q, scales = _int8_case(32, 64)
    row_scales = scales.clone()
    x = torch.zeros(2, 64)
    x[1, 32:] = 1.0  # the first block of row 1 is all zeros
    out = KERNELS.int8_gemm(x, qk.pack_int8(q), row_scales, 32)
    assert torch.equal(out[0], torch.zeros(32))
    _check(out, *_int8_reference(x, q, scales))


@pytest.mark.parametrize("variant", variant_params(("avx512_vnni", "avx512", "avx2")))
def test_every_variant_computes_the_bits_of_the_portable_one(variant: str) -> None:
    # A CPU with AVX512-VNNI gets the VNNI path, one without it the AVX2 path, one without AVX2 the portable
    # C path: the same integer sums and float steps. Row counts cover full and partial row groups.
    kernels, portable = qk.load_quant_kernels(variant), qk.load_quant_kernels("portable")
    assert kernels is not None and portable is not None
    assert (kernels.isa, portable.isa) == ("avx512_vnni" if variant == "avx512_vnni" else "avx2", "portable")
    torch.manual_seed(4)
    q8, scales8 = _int8_case(50, 96)
    row_scales = torch.zeros(64)
    row_scales[:50] = scales8
    q4, scale4, minimum4 = _int4_case(50, 128, 64)
    for rows in (1, 6, 9):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        int8 = [k.int8_gemm(x, qk.pack_int8(q8), row_scales, 50) for k in (kernels, portable)]
        x4 = torch.randn(rows, 128)
        int4 = [
            k.int4_gemm(x4, qk.pack_int4(q4), qk.pack_rows(scale4), qk.pack_rows(minimum4), 64, 50)
            for k in (kernels, portable)
        ]
        assert torch.equal(int8[0], int8[1]) and torch.equal(int4[0], int4[1])
        _check(int8[1], *_int8_reference(x, q8, scales8))
        _check(int4[1], *_int4_reference(x4, q4, scale4, minimum4, 64))


def test_extreme_int8_values_do_not_saturate_the_16_bit_pair_sums() -> None:
    # The AVX2 path sums pairs of products in 16 bits: |w| = |xq| = 127 everywhere is its worst case
    # (2 * 127 * 127 = 32,258 < 32,767). Every build must give the exact integer sum.
    q = torch.full((16, 64), -127, dtype=torch.int8)
    q[::2] = 127
    scales = torch.ones(16)
    x = torch.ones(1, 64)
    x[0, ::3] = -1.0  # xq = +-127 in every block
    for variant in supported_variants():
        kernels = qk.load_quant_kernels(variant)
        assert kernels is not None
        out = kernels.int8_gemm(x, qk.pack_int8(q), scales, 16)
        expected = (q.to(torch.float64) * x.to(torch.float64)).sum(dim=1) / 127.0 * 127.0
        assert torch.equal(out[0], expected.to(torch.float32))


def test_pack_and_unpack_round_trip_with_padding() -> None:
    torch.manual_seed(5)
    q8 = torch.randint(-127, 128, (23, 64), dtype=torch.int8)
    assert qk.pack_int8(q8).shape == (2, 2, 8, 16, 4)
    assert torch.equal(qk.unpack_int8(qk.pack_int8(q8), 23), q8)
    q4 = torch.randint(0, 16, (23, 64), dtype=torch.uint8)
    assert qk.pack_int4(q4).shape == (2, 2, 4, 16, 4)
    assert torch.equal(qk.unpack_int4(qk.pack_int4(q4), 23), q4)
    values = torch.randn(23, 3).to(torch.float16)
    assert torch.equal(qk.unpack_rows(qk.pack_rows(values), 23), values)


def test_inputs_the_kernel_cannot_read_raise_value_errors_naming_them() -> None:
    q, scales = _int8_case(16, 64)
    tiles, row_scales = qk.pack_int8(q), scales
    with pytest.raises(ValueError, match=r"x must be \(rows, 64\), got \(1, 32\)"):
        KERNELS.int8_gemm(torch.randn(1, 32), tiles, row_scales, 16)
    with pytest.raises(ValueError, match="x must be a contiguous CPU float32 or bfloat16 tensor"):
        KERNELS.int8_gemm(torch.randn(64, 2).t(), tiles, row_scales, 16)
    with pytest.raises(ValueError, match="row_scales must be float32"):
        KERNELS.int8_gemm(torch.randn(1, 64), tiles, row_scales.double(), 16)
    q4, scale, minimum = _int4_case(16, 64, 32)
    with pytest.raises(ValueError, match=r"scales must be contiguous float16 of shape \(1, 2, 16\)"):
        KERNELS.int4_gemm(torch.randn(1, 64), qk.pack_int4(q4), qk.pack_rows(scale.float()), qk.pack_rows(minimum), 32, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_ties_round_half_to_even_in_every_build(dtype: torch.dtype) -> None:
    # max |x| = 127 makes the activation's scale exactly 1, so x * (127 / max|x|) lands on the ties
    # themselves: xq = round half to even (0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2), in every build.
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5])
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 32] = 127.0, -127.0
    x[0, 1:9], x[0, 40:48] = ties, -ties
    weights = torch.ones(16, 64, dtype=torch.int8)
    weights[:, 32:] = -1
    expected = float(torch.round(x[0, :32]).sum() - torch.round(x[0, 32:]).sum())
    assert expected == 127 + 0 + 2 + 2 - 0 - 2 - 2 + 4 - 4 + 127
    for variant in supported_variants():
        kernels = qk.load_quant_kernels(variant)
        assert kernels is not None
        out = kernels.int8_gemm(x.to(dtype), qk.pack_int8(weights), torch.ones(16), 16)
        assert torch.equal(out[0], torch.full((16,), expected, dtype=dtype)), kernels.isa


def test_int8_tiles_taken_in_pairs_give_the_bits_of_one_tile_at_a_time() -> None:
    # From PAIR_MIN_ROWS (16) rows the VNNI variant reads two tiles of output rows per pass; fewer rows read
    # one. Rows are independent of the batch, so each row alone gives what the paired pass must. Odd and even
    # tile counts, full and partial row groups.
    torch.manual_seed(6)
    for out_features in (40, 50, 64):  # 3, 4 and 4 tiles of 16
        q, scales = _int8_case(out_features, 96)
        row_scales = torch.zeros(qk.padded(out_features, qk.TILE))
        row_scales[:out_features] = scales
        for rows in (1, 15, 16, 17, 33):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            paired = KERNELS.int8_gemm(x, qk.pack_int8(q), row_scales, out_features)
            one_by_one = torch.cat([KERNELS.int8_gemm(x[r : r + 1], qk.pack_int8(q), row_scales, out_features)
                                    for r in range(rows)])
            assert torch.equal(paired, one_by_one), (out_features, rows)
            _check(paired, *_int8_reference(x, q, scales))


@pytest.mark.parametrize("threads", [1, 2])
def test_outputs_as_wide_as_an_lm_head_written_past_the_cache_give_the_same_bits(threads: int) -> None:
    # From 16,384 outputs a row and 4 rows (quant_gemv.c's STREAM_MIN_N, STREAM_MIN_ROWS) the VNNI variant
    # writes float32 results with non-temporal stores, each thread fencing its own: every row must read back
    # what it gives alone (one row is written through the cache). 1,025 tiles: the paired pass and the odd
    # last tile; 16,384 outputs: the paired pass alone.
    torch.manual_seed(7)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for out_features in (16400, 16384):
            q8, scales8 = _int8_case(out_features, 64)
            q4, scale4, minimum4 = _int4_case(out_features, 64, 32)
            int8_tiles, int4_tiles = qk.pack_int8(q8), qk.pack_int4(q4)
            scales4, minimums4 = qk.pack_rows(scale4), qk.pack_rows(minimum4)
            for rows in (4, 33):
                x = torch.randn(rows, 64)
                int8 = KERNELS.int8_gemm(x, int8_tiles, scales8, out_features)
                int4 = KERNELS.int4_gemm(x, int4_tiles, scales4, minimums4, 32, out_features)
                assert torch.equal(int8, torch.cat([KERNELS.int8_gemm(x[r : r + 1], int8_tiles, scales8, out_features)
                                                    for r in range(rows)]))
                assert torch.equal(int4, torch.cat([KERNELS.int4_gemm(x[r : r + 1], int4_tiles, scales4, minimums4,
                                                                      32, out_features) for r in range(rows)]))
                _check(int8, *_int8_reference(x, q8, scales8))
                _check(int4, *_int4_reference(x, q4, scale4, minimum4, 32))
    finally:
        torch.set_num_threads(previous)
