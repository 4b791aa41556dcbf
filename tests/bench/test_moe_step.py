"""benchmarks.moe_step: the dense twin has the MoE's active parameters; the bytes a step must read."""

from __future__ import annotations

import argparse

from benchmarks.moe_step import _bytes_per_step, _config


def _args() -> argparse.Namespace:
    return argparse.Namespace(num_layers=2, experts=8, top_k=2, expert_width=96)


def test_the_dense_twin_has_the_active_parameters_of_the_moe() -> None:
    moe, dense = _config(True, _args()), _config(False, _args())
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.mlp_only_layers) == (8, 2, 96, [])
    assert dense.intermediate_size == moe.num_experts_per_tok * moe.moe_intermediate_size == 192
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(moe, name) == getattr(dense, name), name


def test_a_step_reads_the_touched_experts_and_the_kv_but_not_the_embedding() -> None:
    from pdserve.engine.models.llama import Qwen3MoeForCausalLM

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
