"""A checkpoint with the embedded default model's architecture and random weights.

    python -m benchmarks.random_checkpoint OUT_DIR [--num-layers N] [--seed 0]

Speed depends on the shapes, not on the values: where the default model's
weights cannot go (a lent GPU machine reaches no package index, and the
converted weights are larger than what may travel there), a benchmark loads this
folder instead and times the same work. Its greedy outputs are noise, but every
system loads the same weights, so exactness between systems still holds.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

# SmolLM2-135M-Instruct, as engine.default_model converts it (tests/bench/test_random_checkpoint.py
# checks these against the converted config.json).
SMOLLM2_135M: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 9.999999747378752e-06,  # 1e-5 as the GGUF file stores it, in float32
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def write_random_checkpoint(out_dir: Path, num_layers: int | None = None, seed: int = 0) -> Path:
    """Write a float32 LlamaForCausalLM of SmolLM2-135M's shape (``num_layers`` layers if given) to ``out_dir``."""
    from transformers import LlamaConfig

    fields = dict(SMOLLM2_135M)
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    return write_config_checkpoint(out_dir, LlamaConfig(**fields), seed)


def write_config_checkpoint(out_dir: Path, config: Any, seed: int = 0) -> Path:
    """Write a float32 model of ``config`` (a transformers config) with random weights, seeded, to ``out_dir``;
    its generation config names token 1 BOS and 2 EOS and padding."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-layers", type=int, default=None, help="default: the model's 30")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_random_checkpoint(args.out_dir, args.num_layers, args.seed))


if __name__ == "__main__":
    main()
