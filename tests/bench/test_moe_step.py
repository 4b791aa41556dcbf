"""benchmarks.moe_step: the dense twin has the MoE's active parameters; the bytes and multiply-adds a step must do."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.moe_step import (
    _bytes_per_step,
    _config,
    _macs_per_step,
    _phase_bytes,
    compute_bound_s,
    crossover_gbps,
    phase_compute_s,
    phase_roofline_s,
)


def _args() -> argparse.Namespace:
    return argparse.Namespace(num_layers=2, experts=8, top_k=2, expert_width=96)


def test_the_dense_twin_has_the_active_parameters_of_the_moe() -> None:
    moe, dense = _config(True, _args()), _config(False, _args())
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.mlp_only_layers) == (8, 2, 96, [])
    assert dense.intermediate_size == moe.num_experts_per_tok * moe.moe_intermediate_size == 192
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(moe, name) == getattr(dense, name), name


def test_a_step_reads_the_touched_experts_and_the_kv_but_not_the_embedding() -> None:
    from pdserve.engine.models.qwen import Qwen3MoeForCausalLM

    config = _config(True, _args())
    config.vocab_size = 64
    model = Qwen3MoeForCausalLM(config, 128)
    model.pack_weights()
    attention = 9 * 64 * 576 + 2 * (3 * 64 * 576) + 576 * 9 * 64 + 2 * 64 + 2 * 576  # q, k, v, o, q/k norms, norms
    expert = 3 * 576 * 96
    head = 64 * 576  # the LM head (tied: the embedding's tensor, which a step reads as the head)
    weights = 2 * (attention + 8 * 576 + 5 * expert) + 576 + head  # 5 of 8 experts touched; the router; final norm
    kv = 2 * 2 * 3 * 64 * 4 * 100 * 32  # K and V, 2 layers, 3 heads of 64, float32, 100 positions, 32 sequences
    assert _bytes_per_step(model, experts_touched=5, context=100) == 4 * weights + kv
    # The same bytes, by the phase that reads them.
    assert _phase_bytes(model, experts_touched=5, context=100) == {
        "attention": 4 * 2 * attention - 4 * 2 * 2 * 576,  # the layer norms are not attention's
        "kv": kv,
        "router": 4 * 2 * 8 * 576,
        "experts": 4 * 2 * 5 * expert,
        "head": 4 * head,
        "other": 4 * (2 * 2 * 576 + 576),  # each layer's two norms and the final one
    }


def test_a_step_multiplies_each_token_by_its_experts_the_attention_and_the_head() -> None:
    moe, dense = _config(True, _args()), _config(False, _args())
    attention = 576 * 64 * (2 * 9 + 2 * 3)  # q and o: 9 heads of 64; k and v: 3
    assert _macs_per_step(moe, 32) == {
        "decoder": 32 * 2 * (attention + 2 * 3 * 576 * 96),  # 2 layers; each token through 2 experts of 96
        "router": 32 * 2 * 576 * 8,
        "head": 32 * 576 * 49152,
    }
    assert _macs_per_step(dense, 32) == {
        "decoder": 32 * 2 * (attention + 3 * 576 * 192), "router": 0, "head": 32 * 576 * 49152,
    }


def test_the_compute_bound_takes_each_kind_at_its_peak_and_leaves_out_unmeasured_float_work() -> None:
    macs = {"decoder": 10**9, "router": 10**6, "head": 2 * 10**9}
    peaks = {"decoder": "int8 vnni", "router": "f32 avx512", "head": "int8 vnni"}
    rates = {"int8 vnni": 200.0, "f32 avx512": 50.0}  # GMAC/s per core
    assert compute_bound_s(macs, peaks, rates, "float32", 2) == pytest.approx(1e9 / 400e9 + 1e6 / 100e9 + 2e9 / 400e9)
    # bf16 products have no measured peak (bf16 units outrun float32 FMA): the router drops out of the bound.
    assert compute_bound_s(macs, peaks, rates, "bfloat16", 2) == pytest.approx(3e9 / 400e9)
    # A loop this CPU does not run (no rate) bounds nothing.
    assert compute_bound_s(macs, {**peaks, "head": "int4 avx2"}, rates, "float32", 1) == pytest.approx(
        1e9 / 200e9 + 1e6 / 50e9
    )


def test_the_phase_roofline_takes_each_phase_at_its_larger_bound_and_the_crossover_solves_for_the_rate() -> None:
    config = _config(True, _args())
    rates = {"int8 vnni": 200.0, "f32 avx512": 50.0}
    peaks = {"decoder": "int8 vnni", "router": "f32 avx512", "head": "int8 vnni"}
    compute = phase_compute_s(config, 100, peaks, rates, "float32", 2)
    attention = 576 * 64 * (2 * 9 + 2 * 3)
    assert compute == pytest.approx({
        "attention": 32 * 2 * attention / 400e9,
        "kv": 32 * 2 * 9 * 64 * 2 * 100 / 100e9,  # scores and weighted values: 9 query heads, 100 positions
        "router": 32 * 2 * 576 * 8 / 100e9,
        "experts": 32 * 2 * 2 * 3 * 576 * 96 / 400e9,
        "head": 32 * 576 * 49152 / 400e9,
    })
    # bf16 steps: the float32-peak phases drop out, as in compute_bound_s.
    assert phase_compute_s(config, 100, peaks, rates, "bfloat16", 2)["kv"] == 0.0
    phase_bytes = {"experts": 8e6, "head": 1e6, "other": 1e6}
    phase_compute = {"experts": 1e-4, "head": 2e-3}
    # At 10 GB/s: experts 0.8 ms of bytes (over 0.1 of arithmetic), the head 2 ms of arithmetic, other 0.1 ms.
    assert phase_roofline_s(phase_bytes, phase_compute, 10.0) == pytest.approx(0.8e-3 + 2e-3 + 0.1e-3)
    # 1.5x the memory bound (15 MB) equals the roofline where 9 MB + 2e-3 s * rate = 15 MB: 3 GB/s.
    assert crossover_gbps(phase_bytes, phase_compute) == pytest.approx(3.0)
    assert phase_roofline_s(phase_bytes, phase_compute, 3.0) == pytest.approx(1.5 * 10e6 / 3e9)
    # Only memory-bound phases: no rate makes the target unreachable.
    assert crossover_gbps(phase_bytes, {}) == float("inf")
