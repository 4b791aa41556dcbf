"""Model architectures, chosen by the checkpoint's ``architectures`` field."""

from __future__ import annotations

from typing import Any

from pdserve.engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}

SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class for a checkpoint; falls back on ``model_type`` when ``architectures`` is absent."""
    names = list(getattr(hf_config, "architectures", None) or [])
    by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    if not names and getattr(hf_config, "model_type", None) in by_type:
        names = [by_type[hf_config.model_type]]
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise ValueError(
        f"model architecture {names or getattr(hf_config, 'model_type', None)!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    )
