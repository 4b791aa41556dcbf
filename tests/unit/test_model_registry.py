"""The architecture registry: each family's class, refusals that name what is served, sliding windows."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine import LLM
from pdserve.engine.models import SUPPORTED_ARCHITECTURES, model_class
from pdserve.engine.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Olmo2ForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    sliding_windows,
)
from tests.conftest import _tiny_mistral_config, _tiny_qwen3_config, build_checkpoint


def test_every_family_has_its_class_by_architecture_and_by_model_type() -> None:
    from transformers import LlamaConfig, MistralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config

    expected = {
        LlamaConfig: LlamaForCausalLM,
        MistralConfig: MistralForCausalLM,
        Qwen2Config: Qwen2ForCausalLM,
        Qwen3Config: Qwen3ForCausalLM,
        Olmo2Config: Olmo2ForCausalLM,
        Phi3Config: Phi3ForCausalLM,
    }
    for config_class, cls in expected.items():
        config = config_class()
        assert model_class(config) is cls  # no architectures: by model_type
        config.architectures = [cls.__name__]
        assert model_class(config) is cls
    assert SUPPORTED_ARCHITECTURES == (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM",
        "Phi3ForCausalLM",
    )


def test_an_unsupported_architecture_is_refused_listing_the_supported_ones() -> None:
    from transformers import GPT2Config

    config = GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as error:
        model_class(config)
    assert str(error.value) == (
        "model architecture ['GPT2LMHeadModel'] is not supported (supported: LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, Olmo2ForCausalLM, Phi3ForCausalLM)"
    )


def test_sliding_windows_per_layer_from_each_config_style() -> None:
    from transformers import MistralConfig, Qwen2Config

    assert sliding_windows(MistralConfig(num_hidden_layers=3, sliding_window=256)) == [256, 256, 256]
    assert sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    # Qwen2: off unless use_sliding_window; then the layers from max_window_layers on slide.
    assert sliding_windows(Qwen2Config(num_hidden_layers=3, sliding_window=64)) == [None, None, None]
    qwen = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert sliding_windows(qwen) == [None, 64, 64]


def test_each_layer_gets_its_window_unless_no_sequence_outgrows_it(tmp_path: Path) -> None:
    path = build_checkpoint(tmp_path, _tiny_mistral_config())  # sliding_window=48
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16)
    assert [layer.self_attn.window for layer in llm.engine.model.model.layers] == [48, 48, 48]
    # max_model_len 48: no token ever has more than 48 positions to see, so the layers attend to all of them
    # (and the fused decode step, which has no window, may serve them).
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, max_model_len=48)
    assert [layer.self_attn.window for layer in llm.engine.model.model.layers] == [None, None, None]
    assert llm.engine.model.fused_decode_layout is True


def test_qwen3_layers_normalise_each_head(tmp_path: Path) -> None:
    llm = LLM(model=str(build_checkpoint(tmp_path, _tiny_qwen3_config())), dtype="float32", num_kv_blocks=16)
    attention = llm.engine.model.model.layers[0].self_attn
    assert (attention.qk_norm, attention.head_dim, tuple(attention.q_norm.weight.shape)) == ("head", 24, (24,))
    assert attention.qkv_proj.bias is not None  # attention_bias=True in the tiny config
