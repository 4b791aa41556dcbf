"""Mistral: Llama's layout with a sliding window."""

from __future__ import annotations

from typing import Any

from pdserve.engine.models.llama import FamilyOptions, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layout, every layer with the config's ``sliding_window`` when it sets one."""

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        return FamilyOptions()
