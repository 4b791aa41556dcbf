"""Model architectures, chosen by the checkpoint's ``architectures`` field (vLLM's registry, in small)."""

from __future__ import annotations

from typing import Any

from pdserve.engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pdserve.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.mistral import MistralForCausalLM
from pdserve.engine.models.mixtral import MixtralForCausalLM
from pdserve.engine.models.olmo2 import Olmo2ForCausalLM
from pdserve.engine.models.phi3 import Phi3ForCausalLM
from pdserve.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
# A config without ``architectures`` names its family by ``model_type``.
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class for a checkpoint; falls back on ``model_type`` when ``architectures`` is absent."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:
        names = [_BY_MODEL_TYPE[hf_config.model_type]]
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise ValueError(
        f"model architecture {names or getattr(hf_config, 'model_type', None)!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    )
