"""Mixtral."""

from __future__ import annotations

from typing import Any

from pdserve.engine.models.llama import FamilyOptions, LlamaForCausalLM, MoEOptions


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: every layer's MLP is ``num_local_experts`` experts, ``num_experts_per_tok`` of them per token,
    their routing weights renormalised (in float32); the checkpoint's ``block_sparse_moe.experts.N.w1/w3/w2``
    load as each expert's gate/up/down."""

    _EXPERT_RENAMES = ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        moe = MoEOptions(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            normalise=True,
            weights_in_model_dtype=False,
        )
        return FamilyOptions(moe=moe, moe_layers=tuple(range(config.num_hidden_layers)))

    def checkpoint_parts(self, key: str) -> list[tuple[str, None]] | None:
        if ".block_sparse_moe." not in key:
            return None
        name = key.replace(".block_sparse_moe.", ".mlp.", 1)
        for old, new in self._EXPERT_RENAMES:
            name = name.replace(old, new)
        return [(name, None)]
