"""KV bytes a handoff moves per prompt token: multi-head latent attention against multi-head attention.

    python -m benchmarks.mla_handoff [--prompt-len 1000] [--num-layers 2] [--kv-cache-dtype auto]

Random checkpoints of one width (DeepSeek-V2-Lite's attention: hidden 2048, 16
heads; ``--num-layers`` layers, dense MLPs, a 1,024-token vocabulary, since
neither changes what a token's KV holds):

- ``mla``: DeepSeek-V2 latent attention, ``kv_lora_rank`` 512 plus a 64-feature
  rope part cached per token and layer;
- ``mha``: Llama with the same 16 heads of 128 features, keys and values each;
- ``gqa``: the same with 4 KV heads (a common grouped-query shape, for scale).

Each prompt of ``--prompt-len`` random tokens is prefilled with its KV held, as a
prefill worker holds it for a decode worker, and the held blocks are exported as a
transfer ships them (``LeaseTable.export``: the one tensor every transport moves).
Reported: bytes moved, bytes per prompt token, and the MHA-over-MLA ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.random_checkpoint import write_config_checkpoint

HIDDEN = 2048
HEADS = 16
VOCAB = 1024


def _configs(num_layers: int) -> dict[str, Any]:
    from transformers import DeepseekV2Config, LlamaConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1408, num_hidden_layers=num_layers,
                  num_attention_heads=HEADS, max_position_embeddings=4096, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    mla = DeepseekV2Config(
        **common, num_key_value_heads=HEADS, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, first_k_dense_replace=num_layers,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    mha = LlamaConfig(**common, num_key_value_heads=HEADS, head_dim=128)
    gqa = LlamaConfig(**common, num_key_value_heads=4, head_dim=128)
    return {"mla": mla, "mha": mha, "gqa": gqa}


def _write(folder: Path, config: Any) -> Path:
    return write_config_checkpoint(folder, config)


def measure(path: Path, prompt_len: int, kv_cache_dtype: str) -> dict[str, Any]:
    """Prefill one prompt with its KV held, export the held blocks; what a handoff moves."""
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.types.handoff import KVHoldParams

    engine = LLM(model=str(path), dtype="float32", num_kv_blocks=-(-prompt_len // 16) + 2,
                 kv_cache_dtype=kv_cache_dtype, max_model_len=prompt_len + 16).engine
    prompt = [random.Random(prompt_len).randrange(3, VOCAB) for _ in range(prompt_len)]
    hold = KVHoldParams(transport="grpc", address="127.0.0.1:1", worker_id="benchmark", epoch=1)
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=hold)
    handoff = None
    while handoff is None:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                handoff = out.kv_handoff
    assert handoff is not None
    blocks = engine.leases.export(request_id, 0)
    engine.leases.release(request_id)
    moved = blocks.numel() * blocks.element_size()
    return {
        "layout": dataclasses.asdict(handoff.layout),
        "blocks": handoff.num_blocks,
        "bytes": moved,
        "bytes_per_token": moved / prompt_len,
        "bytes_per_token_per_layer": moved / prompt_len / handoff.layout.num_layers,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (float32), bfloat16 or int8")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in _configs(args.num_layers).items():
            results[name] = measure(_write(Path(tmp) / name, config), args.prompt_len, args.kv_cache_dtype)
    print(f"{args.prompt_len}-token prompt, {args.num_layers} layers, KV {args.kv_cache_dtype}")
    print(f"{'model':<6}{'KV rows per token and layer':<34}{'bytes moved':>14}{'per token':>12}{'x MLA':>8}")
    for name, result in results.items():
        layout = result["layout"]
        rows = f"{layout['kv_parts']} x {layout['num_kv_heads']} heads x {layout['head_dim']}"
        ratio = result["bytes"] / results["mla"]["bytes"]
        print(f"{name:<6}{rows:<34}{result['bytes']:>14,}{result['bytes_per_token']:>12,.0f}{ratio:>8.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
