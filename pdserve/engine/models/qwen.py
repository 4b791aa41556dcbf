"""Qwen2, Qwen3 and Qwen3-MoE."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.engine.models.llama import FamilyOptions, LlamaForCausalLM, MoEOptions


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on q/k/v (not on o), usually tied embeddings."""

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        return FamilyOptions(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: an RMSNorm over each head of q and k before the rotation, an explicit head_dim, optional
    q/k/v/o biases (``attention_bias``)."""

    fused_decode_layout = False

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return FamilyOptions(qkv_bias=bias, o_bias=bias, qk_norm="head")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3's attention; experts of ``moe_intermediate_size`` in every ``decoder_sparse_step``-th
    layer not in ``mlp_only_layers``, ``num_experts_per_tok`` per token, renormalised where
    ``norm_topk_prob``."""

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        layers = tuple(
            i for i in range(config.num_hidden_layers)
            if i not in dense and config.num_experts > 0 and (i + 1) % step == 0
        )
        moe = MoEOptions(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            normalise=bool(config.norm_topk_prob),
            weights_in_model_dtype=True,
        )
        return dataclasses.replace(super().family_options(config), moe=moe, moe_layers=layers)
