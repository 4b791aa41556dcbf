"""OLMo 2."""

from __future__ import annotations

from typing import Any

from pdserve.engine.models.llama import FamilyOptions, LlamaForCausalLM


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2: RMSNorm over all heads of q and of k, and norms after each sublayer instead of before."""

    fused_decode_layout = False
    tensor_parallel_reason = "OLMo 2 normalises q and k over all heads at once, which tensor parallelism splits"

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return FamilyOptions(qkv_bias=bias, o_bias=bias, qk_norm="all_heads", norm_placement="post")
