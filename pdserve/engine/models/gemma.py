"""Gemma 2 and Gemma 3 (text)."""

from __future__ import annotations

from typing import Any

from pdserve.engine.models.llama import FamilyOptions, LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: norms before and after each sublayer, each multiplying by (1 + w); embeddings scaled by
    sqrt(hidden_size); scores scaled by ``query_pre_attn_scalar`` and soft-capped, logits soft-capped; GeGLU;
    sliding and global layers in turn."""

    fused_decode_layout = False
    # Gemma 3 adds per-head q/k norms.
    gemma_qk_norm: str | None = None

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention=True (an encoder's setting) is not served: generation is causal")
        bias = bool(getattr(config, "attention_bias", False))
        return FamilyOptions(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=cls.gemma_qk_norm,
            norm_placement="sandwich",
            norm_offset=1.0,
            embed_scale=True,
            attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
            attention_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
        )


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2's layout with an RMSNorm over each head of q and k, no soft-caps by default, and
    its own RoPE for the sliding layers (``rope_parameters`` by layer type)."""

    gemma_qk_norm = "head"
