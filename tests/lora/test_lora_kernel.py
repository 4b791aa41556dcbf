"""The LoRA kernel (pdserve/engine/kernels/lora.c) against the dense torch path it replaces on CPU: each row adds
only its own slot's update, on random weights and inputs, float32 within float32 rounding, bfloat16 within one
bfloat16 step, at the lowest variant (forced as the engine's override forces it) and the best this CPU runs.
bfloat16 weights (a bfloat16 model's) against a float64 reference over the same bfloat16-rounded weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.layers.lora import LoRALinear, LoRARows, LoRAState
from pdserve.engine.native import ISA_ENV, load_kernel_ops, supported_variants

IN_FEATURES = 72  # 4 vectors of 16 and a tail of 8
# A packed q/k/v-like projection: three modules, the second ending off a 16-column boundary.
SLICES = {"q_proj": (0, 40), "k_proj": (40, 61), "v_proj": (61, 80)}
SLOTS, MAX_RANK = 4, 8


def _pair(variant: str, dtype: torch.dtype, seed: int,
          weights_dtype: torch.dtype = torch.float32) -> tuple[LoRALinear, LoRALinear]:
    """One projection's kernel and dense forms over the same base and slots, their adapter weights kept in
    ``weights_dtype``; slot 3 stays empty. The kernels are the engine's choice (``install``'s): ``variant`` where
    the override names it."""
    generator = torch.Generator().manual_seed(seed)
    base = nn.Linear(IN_FEATURES, max(end for _, end in SLICES.values()), dtype=dtype)
    kernels = load_kernel_ops()
    assert kernels is not None, "pdserve was installed without its kernels (PDSERVE_BUILD_KERNELS=0?)"
    assert kernels.name == variant
    state = LoRAState(SLOTS)
    kernel = LoRALinear(base, SLICES, IN_FEATURES, SLOTS, MAX_RANK, state, torch.device("cpu"), kernels,
                        weights_dtype)
    dense = LoRALinear(base, SLICES, IN_FEATURES, SLOTS, MAX_RANK, state, torch.device("cpu"), None, weights_dtype)
    # Ranks below max_rank, odd ones (not a multiple of the kernel's 4 rows of A), and modules left out.
    for slot, (rank, modules) in enumerate([(8, SLICES), (3, ["q_proj", "v_proj"]), (5, ["k_proj"])]):
        weights = {module: (torch.randn(rank, IN_FEATURES, generator=generator) * 0.3,
                            torch.randn(SLICES[module][1] - SLICES[module][0], rank, generator=generator) * 0.3)
                   for module in modules}
        kernel.set_slot(slot, weights)
        dense.set_slot(slot, weights)
    return kernel, dense


def _rows(slots: list[int]) -> LoRARows:
    per_token = torch.tensor(slots)
    return LoRARows.of(per_token, torch.tensor([0.5, 2.0, -1.25, 3.0, 0.0])[per_token])


# Mixed slots with base rows, unsorted; more rows of one slot than the kernel takes at once; one row; all base
# rows but one; an empty slot's rows (nothing to add).
ROWS = [
    [2, -1, 0, 1, 0, -1, 2, 1, 0],
    [1] * 7 + [0, -1, 0],
    [0],
    [-1, -1, 1, -1],
    [3, 0, 3],
]


@pytest.fixture(params=["lowest", "best"])
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The lowest variant, forced through the override (PDSERVE_CPU_ISA), or the best this CPU runs."""
    if request.param == "lowest":
        monkeypatch.setenv(ISA_ENV, supported_variants()[0])
        return supported_variants()[0]
    monkeypatch.delenv(ISA_ENV, raising=False)
    return supported_variants()[-1]


@pytest.mark.parametrize("slots", ROWS, ids=[f"rows{i}" for i in range(len(ROWS))])
def test_float32_rows_add_their_own_slots_update_as_the_dense_path_does(variant: str, slots: list[int]) -> None:
    kernel, dense = _pair(variant, torch.float32, seed=len(slots))
    x = torch.randn(len(slots), IN_FEATURES, generator=torch.Generator().manual_seed(7))
    kernel.state.set(_rows(slots))

    out, expected = kernel(x), dense(x)

    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    base = kernel.base(x)
    for row, slot in enumerate(slots):
        if slot in (-1, 3):  # the base model's rows and the empty slot's: untouched, bit for bit
            assert torch.equal(out[row], base[row])


@pytest.mark.parametrize("slots", ROWS[:3], ids=[f"rows{i}" for i in range(3)])
def test_bfloat16_rows_are_within_one_bfloat16_step_of_the_dense_path(variant: str, slots: list[int]) -> None:
    kernel, dense = _pair(variant, torch.bfloat16, seed=10 + len(slots))
    x = torch.randn(len(slots), IN_FEATURES, generator=torch.Generator().manual_seed(8)).bfloat16()
    kernel.state.set(_rows(slots))

    out, expected = kernel(x), dense(x)

    assert out.dtype == torch.bfloat16
    # Both round the float32 update to bf16, then the sum; their float32 sums differ in order only: at most one
    # bf16 step of the update and one of the sum apart.
    expected, base = expected.float(), kernel.base(x).float()
    step = (expected.abs() + (expected - base).abs()) * 2**-7
    assert ((out.float() - expected).abs() <= step).all()
    assert not torch.equal(out.float(), base)  # the update is there


def _reference_update(kernel: LoRALinear, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Each row's update in float64 from the weights as the layer holds them (bfloat16: already rounded), the
    slots' modules read back from the layer's buffers by its documented layout."""
    rows = _rows(slots)
    update = torch.zeros(len(slots), kernel.out_features, dtype=torch.float64)
    modules = len(kernel.slices)
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        for position, (start, end) in enumerate(kernel.slices.values()):
            rank = int(kernel.ranks[slot, position])
            first = (slot * modules + position) * MAX_RANK
            a = kernel.lora_a[first : first + rank].double()  # (rank, in)
            b = kernel.lora_b[slot * MAX_RANK : slot * MAX_RANK + rank, start:end].double()  # (rank, columns)
            update[row, start:end] = float(rows.scales[row]) * (a @ x[row].double()) @ b
    return update


@pytest.mark.parametrize("slots", ROWS[:3], ids=[f"rows{i}" for i in range(3)])
def test_bfloat16_weights_add_their_rounded_values_update_summed_in_float32(variant: str, slots: list[int]) -> None:
    # float32 rows over bfloat16 weights: widening bfloat16 is exact and the sums are float32, so the kernel is
    # within float32 rounding of the float64 update over the same rounded weights, as the float32 kernel is.
    kernel, _ = _pair(variant, torch.float32, seed=20 + len(slots), weights_dtype=torch.bfloat16)
    assert kernel.lora_a.dtype == kernel.lora_b.dtype == torch.bfloat16
    x = torch.randn(len(slots), IN_FEATURES, generator=torch.Generator().manual_seed(9))
    kernel.state.set(_rows(slots))

    out = kernel(x)

    expected = kernel.base(x).double() + _reference_update(kernel, x, slots)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slots", ROWS, ids=[f"rows{i}" for i in range(len(ROWS))])
def test_bfloat16_rows_over_bfloat16_weights_are_within_one_bfloat16_step_of_the_float64_update(
    variant: str, slots: list[int]
) -> None:
    # A bfloat16 model's case: bfloat16 rows and weights (AVX512-BF16's vdpbf16ps in the shrink at the best
    # variant here, widened float32 multiply-adds at the lowest). Every product of two bfloat16 values is exact in
    # float32, so the kernel's float32 update is the float64 one's within float32 rounding (relative 2^-24 per
    # term over 72 terms), far below a bfloat16 step (2^-8): rounding the update to bfloat16 and then the sum can
    # land one step of each apart at most, where the exact value lies at a rounding boundary.
    kernel, _ = _pair(variant, torch.bfloat16, seed=30 + len(slots), weights_dtype=torch.bfloat16)
    x = torch.randn(len(slots), IN_FEATURES, generator=torch.Generator().manual_seed(10)).bfloat16()
    kernel.state.set(_rows(slots))

    out = kernel(x)

    base = kernel.base(x)
    update = _reference_update(kernel, x, slots)
    expected = (base.float() + update.float().bfloat16().float()).bfloat16().float()
    step = (expected.abs() + update.float().abs()) * 2**-7
    assert ((out.float() - expected).abs() <= step).all()
    # Off a boundary the roundings agree: nearly every value is the reference's, bit for bit.
    assert (out.float() == expected).float().mean() >= 0.99
    for row, slot in enumerate(slots):
        if slot in (-1, 3):
            assert torch.equal(out[row], base[row])
    if any(slot in (0, 1, 2) for slot in slots):
        assert not torch.equal(out, base)


def test_no_adapter_row_leaves_the_base_output_and_a_wrong_row_count_is_refused(variant: str) -> None:
    kernel, _ = _pair(variant, torch.float32, seed=3)
    x = torch.randn(3, IN_FEATURES)
    kernel.state.set(None)
    assert torch.equal(kernel(x), kernel.base(x))
    kernel.state.set(_rows([0, 1]))
    with pytest.raises(ValueError, match="LoRA rows are for 2 tokens, the projection got 3"):
        kernel(x)


def test_rows_are_grouped_by_slot_in_their_order() -> None:
    rows = _rows([2, -1, 0, 1, 0, -1, 2])
    assert rows.order.tolist() == [2, 4, 3, 0, 6]
    assert rows.group_offsets.tolist() == [0, 2, 3, 5]
    assert rows.scales.tolist() == [-1.25, 0.0, 0.5, 2.0, 0.5, 0.0, -1.25]
