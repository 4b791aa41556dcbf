"""The architecture registry: each family's class, refusals that name what is served, sliding windows."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine import LLM
from pdserve.engine.models import SUPPORTED_ARCHITECTURES, model_class
from pdserve.engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pdserve.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pdserve.engine.models.llama import LlamaForCausalLM, MoE, sliding_windows
from pdserve.engine.models.mistral import MistralForCausalLM
from pdserve.engine.models.mixtral import MixtralForCausalLM
from pdserve.engine.models.olmo2 import Olmo2ForCausalLM
from pdserve.engine.models.phi3 import Phi3ForCausalLM
from pdserve.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
from tests.conftest import _tiny_mistral_config, _tiny_qwen3_config, build_checkpoint


def test_every_family_has_its_class_by_architecture_and_by_model_type() -> None:
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    expected = {
        LlamaConfig: LlamaForCausalLM,
        MistralConfig: MistralForCausalLM,
        Qwen2Config: Qwen2ForCausalLM,
        Qwen3Config: Qwen3ForCausalLM,
        Olmo2Config: Olmo2ForCausalLM,
        Phi3Config: Phi3ForCausalLM,
        Gemma2Config: Gemma2ForCausalLM,
        Gemma3TextConfig: Gemma3ForCausalLM,
        MixtralConfig: MixtralForCausalLM,
        Qwen3MoeConfig: Qwen3MoeForCausalLM,
        DeepseekV2Config: DeepseekV2ForCausalLM,
        DeepseekV3Config: DeepseekV3ForCausalLM,
    }
    for config_class, cls in expected.items():
        config = config_class()
        assert model_class(config) is cls  # no architectures: by model_type
        config.architectures = [cls.__name__]
        assert model_class(config) is cls
    assert SUPPORTED_ARCHITECTURES == (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM",
        "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
        "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    )


def test_an_unsupported_architecture_is_refused_listing_the_supported_ones() -> None:
    from transformers import GPT2Config

    config = GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as error:
        model_class(config)
    assert str(error.value) == (
        "model architecture ['GPT2LMHeadModel'] is not supported (supported: LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, Olmo2ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, MixtralForCausalLM, "
        "Qwen3MoeForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)"
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


def test_gemma_layers_carry_their_scale_caps_windows_and_two_ropes(tmp_path: Path) -> None:
    from tests.conftest import _tiny_gemma2_config, _tiny_gemma3_config

    gemma2 = LLM(model=str(build_checkpoint(tmp_path / "g2", _tiny_gemma2_config())), dtype="float32",
                 num_kv_blocks=16).engine.model
    options = [layer.self_attn.attention_options for layer in gemma2.model.layers]
    capped = {"scale": 24**-0.5, "softcap": 5.0}
    assert options == [{"window": 40, **capped}, capped, {"window": 40, **capped}, capped]
    assert (gemma2.model.final_softcap, gemma2.model.embed_scale, gemma2.model.norm.offset) == (8.0, 8.0, 1.0)
    assert gemma2.model.rotary_local is None and gemma2.fused_decoder is None
    gemma3 = LLM(model=str(build_checkpoint(tmp_path / "g3", _tiny_gemma3_config())), dtype="float32",
                 num_kv_blocks=16).engine.model
    assert [layer.local_rope for layer in gemma3.model.layers] == [True, True, False, True]
    assert [layer.self_attn.window for layer in gemma3.model.layers] == [40, 40, None, 40]
    assert gemma3.model.final_softcap is None and gemma3.model.layers[0].self_attn.qk_norm == "head"
    # The global layers' linear scaling divides every frequency by 8; the local ones keep base 10,000.
    import torch

    assert torch.allclose(gemma3.model.rotary.cos[5, 1], torch.cos(torch.tensor(5 / 8 * 1e6 ** (-2 / 16))))
    assert torch.allclose(gemma3.model.rotary_local.cos[5, 1], torch.cos(torch.tensor(5 * 1e4 ** (-2 / 16))))


def test_an_encoder_setting_is_refused_naming_it(tmp_path: Path) -> None:
    from tests.conftest import _tiny_gemma3_config

    config = _tiny_gemma3_config()
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=True \(an encoder's setting\) is not served"):
        LLM(model=str(build_checkpoint(tmp_path, config)), dtype="float32", num_kv_blocks=16)


def test_moe_layers_follow_the_config_and_mixtral_names_load_as_experts(tmp_path: Path) -> None:
    from tests.conftest import _tiny_mixtral_config, _tiny_qwen3_moe_config

    qwen = LLM(model=str(build_checkpoint(tmp_path / "q", _tiny_qwen3_moe_config())), dtype="float32",
               num_kv_blocks=16).engine.model
    kinds = [type(layer.mlp).__name__ for layer in qwen.model.layers]
    assert kinds == ["MoE", "MLP", "MoE"]  # mlp_only_layers=[1]
    moe = qwen.model.layers[0].mlp
    assert isinstance(moe, MoE) and (len(moe.experts), moe.options.top_k, moe.experts[0].intermediate_size) == (8, 3, 64)
    assert qwen.model.layers[1].mlp.intermediate_size == 160 and qwen.fused_decoder is None
    path = build_checkpoint(tmp_path / "m", _tiny_mixtral_config())
    mixtral = LLM(model=str(path), dtype="float32", num_kv_blocks=16).engine.model
    # block_sparse_moe.experts.N.w1 / w3 / w2 are expert N's gate / up / down, packed gate and up side by side.
    from safetensors import safe_open
    import torch

    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as checkpoint:
        w1 = checkpoint.get_tensor("model.layers.2.block_sparse_moe.experts.5.w1.weight")
        w3 = checkpoint.get_tensor("model.layers.2.block_sparse_moe.experts.5.w3.weight")
        router = checkpoint.get_tensor("model.layers.2.block_sparse_moe.gate.weight")
    expert = mixtral.model.layers[2].mlp.experts[5]
    x = torch.randn(3, 64)
    assert torch.allclose(expert.gate_up_proj(x), x @ torch.cat((w1, w3)).T, atol=1e-5)
    assert torch.equal(mixtral.model.layers[2].mlp.gate.weight, router)
