"""GGUF files of tiny checkpoints, written at test time with the ``gguf`` package as llama.cpp's converter lays
them out (its tensor names, its q/k row order for Llama), with Q8_0 matrices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file

# The families written here, by GGUF architecture (llama.cpp writes Mistral as "llama").
ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2"}


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's row order for Llama's q and k (each head's rotary halves interleaved)."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def write_gguf(checkpoint: Path, config: Any, arch: str, out: Path) -> Path:
    """``checkpoint``'s weights as ``out`` (a GGUF file of ``arch``): 2-D tensors in Q8_0, the rest float32, a
    tokenizer of ``config.vocab_size`` placeholder tokens ("<t9>"; no merges, zero scores)."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_merges([])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHITECTURES[arch]), config.num_hidden_layers)
    for key, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        base, suffix = key.rsplit(".", 1)
        name = names.get_name(base)
        assert name is not None, key
        values = tensor.numpy()
        if arch == "llama" and name.endswith(".attn_q"):
            values = _llama_cpp_permute(values, config.num_attention_heads)
        elif arch == "llama" and name.endswith(".attn_k"):
            values = _llama_cpp_permute(values, config.num_key_value_heads)
        if values.ndim == 2:
            quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(f"{name}.{suffix}", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(f"{name}.{suffix}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
