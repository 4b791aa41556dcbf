"""The LoRA kernel (pdserve/engine/kernels/lora.c) against the dense torch path it replaces on CPU: each row adds
only its own slot's update, on random weights and inputs, float32 within float32 rounding, bfloat16 within one
bfloat16 step, at the lowest variant (forced as the engine's override forces it) and the best this CPU runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.lora import LoRALinear, LoRARows, LoRAState
from pdserve.engine.native import ISA_ENV, load_kernel_ops, supported_variants

IN_FEATURES = 72  # 4 vectors of 16 and a tail of 8
# A packed q/k/v-like projection: three modules, the second ending off a 16-column boundary.
SLICES = {"q_proj": (0, 40), "k_proj": (40, 61), "v_proj": (61, 80)}
SLOTS, MAX_RANK = 4, 8


def _pair(variant: str, dtype: torch.dtype, seed: int) -> tuple[LoRALinear, LoRALinear]:
    """One projection's kernel and dense forms over the same base and slots; slot 3 stays empty. The kernels are
    the engine's choice (``install``'s): ``variant`` where the override names it."""
    generator = torch.Generator().manual_seed(seed)
    base = nn.Linear(IN_FEATURES, max(end for _, end in SLICES.values()), dtype=dtype)
    kernels = load_kernel_ops()
    assert kernels is not None, "pdserve was installed without its kernels (PDSERVE_BUILD_KERNELS=0?)"
    assert kernels.name == variant
    state = LoRAState(SLOTS)
    kernel = LoRALinear(base, SLICES, IN_FEATURES, SLOTS, MAX_RANK, state, torch.device("cpu"), kernels)
    dense = LoRALinear(base, SLICES, IN_FEATURES, SLOTS, MAX_RANK, state, torch.device("cpu"))
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
