"""Tiny checkpoints whose heads split over 2 and 3 ranks, and transformers' greedy reference with its margins."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    _tiny_gemma3_config,
    _tiny_mixtral_config,
    _tiny_phi3_config,
    build_checkpoint,
)

ODD_VOCAB_SIZE = 509


def llama_config(num_heads: int, num_kv_heads: int, bias: bool, vocab_size: int = VOCAB_SIZE) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=96,  # splits over 2 and 3 ranks
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        attention_bias=bias,
        mlp_bias=bias,
        tie_word_embeddings=False,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def qwen2_config() -> object:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def qwen3_config() -> object:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def mistral_config() -> object:
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=10,  # shorter than every prompt but the first of the test
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def qwen3_moe_config() -> object:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=96,
        moe_intermediate_size=24,  # each expert split over 2 ranks: 12 columns each
        num_hidden_layers=2,
        num_experts=6,
        num_experts_per_tok=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def gemma2_config() -> object:
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=12,
        sliding_window=10,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0,  # applied to the whole vocabulary once the ranks' parts are gathered
        tie_word_embeddings=False,
        max_position_embeddings=512,
        initializer_range=0.25,
        bos_token_id=1,
        pad_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
    )


def deepseek_config(v3: bool) -> object:
    from transformers import DeepseekV2Config, DeepseekV3Config

    fields = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=96,  # the dense first layer's
        moe_intermediate_size=24,  # each expert (and the shared one) split over 2 or 3 ranks
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=6,  # 3 or 2 query heads per rank, every rank caching the whole latent
        num_key_value_heads=6,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.25,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )
    if v3:
        return DeepseekV3Config(**fields, q_lora_rank=32, n_group=3, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.0)
    return DeepseekV2Config(**fields, q_lora_rank=None, topk_method="greedy")


def olmo2_config() -> object:
    from transformers import Olmo2Config

    return Olmo2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.25,
        bos_token_id=1,
        pad_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
    )


CONFIGS = {
    # MHA, every projection with a bias (the row-parallel ones added once)
    "mha_bias": lambda: llama_config(6, 6, bias=True),
    # one KV head: fewer KV heads than ranks, replicated on every rank
    "gqa_1kv": lambda: llama_config(6, 1, bias=False),
    # two KV heads: split at TP 2
    "gqa_2kv": lambda: llama_config(6, 2, bias=False),
    # q/k/v biases, tied embeddings
    "qwen2": qwen2_config,
    # a vocabulary that splits unevenly over 2 and 3 ranks (255 + 254, 170 + 170 + 169), untied head
    "odd_vocab": lambda: llama_config(6, 6, bias=False, vocab_size=ODD_VOCAB_SIZE),
    # per-head q/k norms, which each rank applies to its own heads
    "qwen3": qwen3_config,
    # a sliding window, which each rank applies to its own heads
    "mistral": mistral_config,
    # experts, each split over the ranks like an MLP, one all-reduce per layer
    "qwen3_moe": qwen3_moe_config,
    # (1 + w) sandwich norms, scaled embeddings, soft-capped scores and logits, windows on alternate layers
    "gemma2": gemma2_config,
    # the engine tests' own tiny checkpoints: fused q/k/v and gate/up split at load, then by rank (LongRoPE on
    # 3/4 of each head); per-head q/k norms, one KV head replicated, a RoPE per layer type; experts
    "phi3": _tiny_phi3_config,
    "gemma3": _tiny_gemma3_config,
    "mixtral": _tiny_mixtral_config,
    # latent attention: the query heads split, the latent replicated; shared and routed experts split
    "deepseek_v2": lambda: deepseek_config(v3=False),
    # q compression and sigmoid routing within groups
    "deepseek_v3": lambda: deepseek_config(v3=True),
    # q/k norms over all heads: refused
    "olmo2": olmo2_config,
}


def build(directory: Path, name: str) -> Path:
    return build_checkpoint(directory, CONFIGS[name](), seed=3)


class Reference:
    """transformers' greedy tokens for a prompt, and each step's top-2 logit margin."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens, do_sample=False,
                pad_token_id=0,
            )
            tokens = out[0, len(prompt) :].tolist()
            logits = self.model(out[:, :-1]).logits[0, len(prompt) - 1 :]  # the logits each token was chosen from
        top2 = logits.topk(2, dim=-1).values
        return tokens, (top2[:, 0] - top2[:, 1]).tolist()
