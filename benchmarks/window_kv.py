"""KV bytes one sequence holds at 4k tokens: sliding windows freed behind them, against every block kept.

    python -m benchmarks.window_kv [--tokens 4096] [--models gemma3_1b,gemma3_4b,gemma2_2b,mistral_7b]
                                   [--step-model gemma3_4b] [--rounds 2]

Random checkpoints with the KV geometry of real models (layers, layer kinds,
windows, KV heads, head size; a narrow hidden size and a 1,024-token vocabulary,
which change nothing a token's KV holds, and as many query heads as KV heads, so
4k tokens prefill in seconds):

- ``gemma3_1b``: 26 layers, five sliding (window 512) to one global, 1 KV head of 256;
- ``gemma3_4b``: 34 layers, the same pattern with window 1024, 4 KV heads of 256;
- ``gemma2_2b``: 26 layers, sliding (window 4096) and global alternating, 4 KV heads of 256;
- ``mistral_7b``: Mistral-7B-v0.1, 32 layers all sliding by 4096, 8 KV heads of 128.

Each model serves one prompt of ``--tokens`` random tokens (float32 KV), twice
in one run: with the pages its windows left behind freed (the default) and with
``disable_hybrid_kv_cache_manager`` (every block kept in every layer, as a pool
without sliding-window paging holds it). Reported:
the bytes the sequence's KV holds in the pool once its prompt is computed (the
pages its blocks hold, times a page's bytes), both ways, and their ratio.

What the pages cost a step: ``--step-model`` (34 layer groups for Gemma 3 4B's
5 full and 29 sliding layers: a step builds attention metadata per group)
decodes 8 sequences of 1,200-token prompts for 40 steps, paged and with every
block kept, alternated ``--rounds`` times in one process; mean ms per step.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.random_checkpoint import write_config_checkpoint

VOCAB = 1024


def _configs(max_positions: int) -> dict[str, Any]:
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig

    def common(layers: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
        return dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                    num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                    max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0)

    def gemma3(layers: int, kv_heads: int, window: int) -> Any:
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        return Gemma3TextConfig(**common(layers, kv_heads, 256), sliding_window=window, layer_types=kinds,
                                query_pre_attn_scalar=256)

    return {
        "gemma3_1b": gemma3(26, 1, 512),
        "gemma3_4b": gemma3(34, 4, 1024),
        "gemma2_2b": Gemma2Config(**common(26, 4, 256), sliding_window=4096, query_pre_attn_scalar=256),
        "mistral_7b": MistralConfig(**common(32, 8, 128), sliding_window=4096),
    }


def _write(folder: Path, config: Any) -> Path:
    return write_config_checkpoint(folder, config)


def held_bytes(path: Path, tokens: int, paged: bool) -> dict[str, Any]:
    """Serve one ``tokens``-token prompt; the bytes its KV holds once the prompt is computed and its first
    token sampled (``tokens`` + 1 positions, the next query at ``tokens``)."""
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.kv.cache import bytes_per_block

    blocks = -(-(tokens + 1) // 16) + 1
    engine = LLM(model=str(path), dtype="float32", num_kv_blocks=blocks, max_model_len=tokens + 16,
                 enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not paged).engine
    prompt = [random.Random(tokens).randrange(3, VOCAB) for _ in range(tokens)]
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    seq = engine._requests[request_id]
    # After the step that computes the prompt's last chunk (and samples the first token); the second
    # token's step finishes the request.
    while seq.num_computed_tokens < tokens:
        engine.step()
    pages, groups, num_blocks = _held(engine, seq)
    while engine.has_unfinished_requests():
        engine.step()
    layout = engine.kv_layout
    block = bytes_per_block(layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim,
                            engine.kv_cache_dtype, layout.kv_parts)
    return {"blocks": num_blocks, "pages": pages, "groups": groups, "bytes": pages * block // groups,
            "block_bytes": block}


def decode_step_ms(path: Path, paged: bool, batch: int = 8, prompt_len: int = 1200, steps: int = 40) -> float:
    """Mean time of a decode step of ``batch`` sequences past their ``prompt_len``-token prompts."""
    from pdserve.engine import LLM, SamplingParams

    engine = LLM(model=str(path), dtype="float32", num_kv_blocks=batch * -(-(prompt_len + steps) // 16) + 8,
                 max_model_len=prompt_len + steps + 16, enable_prefix_caching=False,
                 disable_hybrid_kv_cache_manager=not paged).engine
    rng = random.Random(prompt_len)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    seqs = [engine._requests[engine.add_request([rng.randrange(3, VOCAB) for _ in range(prompt_len)], params)]
            for _ in range(batch)]
    while any(seq.num_computed_tokens < prompt_len for seq in seqs):
        engine.step()
    start, count = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        count += 1
    return (time.perf_counter() - start) / count * 1000


def _held(engine: Any, seq: Any) -> tuple[int, int, int]:
    """(pages held, pages per block, blocks) of ``seq``; a pool without pages holds one page per block."""
    manager = engine.block_manager
    if hasattr(manager, "num_pages_held"):
        return manager.num_pages_held(seq), manager.layout.num_groups, len(seq.block_table)
    return len(seq.block_table), 1, len(seq.block_table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--models", default="gemma3_1b,gemma3_4b,gemma2_2b,mistral_7b")
    parser.add_argument("--step-model", default="gemma3_4b", help="the model whose decode step is timed ('' for none)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    configs = _configs(args.tokens + 16)
    results: dict[str, Any] = {}
    steps: dict[str, list[float]] = {"paged": [], "full": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = _write(Path(tmp) / name, configs[name])
            results[name] = {"paged": held_bytes(path, args.tokens, True),
                             "full": held_bytes(path, args.tokens, False)}
        if args.step_model:
            path = _write(Path(tmp) / f"step-{args.step_model}", _configs(2048)[args.step_model])
            for _ in range(args.rounds):
                for kind in steps:
                    steps[kind].append(decode_step_ms(path, kind == "paged"))
    print(f"KV one sequence holds at {args.tokens} prompt tokens, float32")
    print(f"{'model':<12}{'window':>8}{'sliding/all':>13}{'windows freed':>16}{'every block':>16}{'ratio':>8}")
    for name, result in results.items():
        config = configs[name]
        kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
        sliding = f"{sum(k == 'sliding_attention' for k in kinds)}/{len(kinds)}"
        paged, full = result["paged"]["bytes"], result["full"]["bytes"]
        print(f"{name:<12}{config.sliding_window:>8}{sliding:>13}{paged:>16,}{full:>16,}{paged / full:>8.3f}")
    if args.step_model:
        paged, full = (sum(times) / len(times) for times in steps.values())
        print(f"decode step, {args.step_model}, 8 x 1,200 tokens: paged {paged:.1f} ms, every block kept "
              f"{full:.1f} ms (rounds: {steps['paged']} / {steps['full']}); paged / kept {paged / full:.2f}")
        results["decode_step_ms"] = steps
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
