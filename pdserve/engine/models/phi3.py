"""Phi-3 and Phi-4 mini."""

from __future__ import annotations

from typing import Any

from pdserve.engine.models.llama import FamilyOptions, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4 mini: Llama's layout, with q/k/v and gate/up fused in the checkpoint (split at load),
    LongRoPE scaling, a ``partial_rotary_factor`` (Phi-4 mini) and an optional ``sliding_window``."""

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        return FamilyOptions()

    def checkpoint_parts(self, key: str) -> list[tuple[str, tuple[int, int]]] | None:
        """The parameters a fused checkpoint tensor fills, by rows (model_loader.load_weights)."""
        prefix, _, name = key.rpartition(".")
        if prefix.endswith(".self_attn.qkv_proj") and name in ("weight", "bias"):
            attention = self.model.layers[0].self_attn
            q = attention.num_heads * attention.head_dim
            kv = attention.num_kv_heads * attention.head_dim
            base = prefix.removesuffix("qkv_proj")
            return [(f"{base}q_proj.{name}", (0, q)), (f"{base}k_proj.{name}", (q, q + kv)),
                    (f"{base}v_proj.{name}", (q + kv, q + 2 * kv))]
        if prefix.endswith(".mlp.gate_up_proj") and name in ("weight", "bias"):
            intermediate = self.config.intermediate_size
            base = prefix.removesuffix("gate_up_proj")
            return [(f"{base}gate_proj.{name}", (0, intermediate)),
                    (f"{base}up_proj.{name}", (intermediate, 2 * intermediate))]
        return None
