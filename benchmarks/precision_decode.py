"""Decode speed and weight memory of the default model per weight setting, side by side in one process.

    python -m benchmarks.precision_decode [--threads 2] [--batches 1,32] [--rounds 3] [--max-tokens 32]

Settings: float32, bf16, INT8 and INT4 (group 64) weights on float32 and on
bf16 activations. Every setting's engine is built once; then, per round and
per batch size, each runs the same greedy generation (prompts of 32 random
tokens, ``--max-tokens`` new ones, ``ignore_eos``) in turn, so the machine's
noise falls on all alike. Reported: output tokens per second over the whole
generate call (prefill included; at 32 new tokens per prompt decode dominates),
best of the rounds, and the bytes of every parameter and buffer the model
keeps (packed GEMM copies counted; the LM head is tied to the embedding).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.layers.linear import PackedLinear

SETTINGS = {
    "float32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8 (fp32 act.)": {"dtype": "float32", "quantization": "int8"},
    "int8 (bf16 act.)": {"dtype": "bfloat16", "quantization": "int8"},
    "int4 g64 (fp32 act.)": {"dtype": "float32", "quantization": "int4"},
    "int4 g64 (bf16 act.)": {"dtype": "bfloat16", "quantization": "int4"},
}


def model_weight_bytes(llm: LLM) -> int:
    """Bytes of every distinct parameter and buffer of the model, plus the packed GEMM copies."""
    model = llm.engine.model
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            total += sum(t.numel() * t.element_size() for t in (layer._mkl_weight, layer._onednn_weight) if t is not None)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.settings.split(",")
    llms = {name: LLM(num_kv_blocks=512, **SETTINGS[name]) for name in names}
    for name, llm in llms.items():
        print(f"{name:<22} weights {model_weight_bytes(llm) / 1e6:8.1f} MB", flush=True)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    best: dict[tuple[str, int], float] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [[rng.randrange(100, 40000) for _ in range(32)] for _ in range(batch)]
        for name, llm in llms.items():
            llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        for _ in range(args.rounds):
            for name, llm in llms.items():
                started = time.perf_counter()
                llm.generate(prompts, params)
                rate = batch * args.max_tokens / (time.perf_counter() - started)
                print(f"  round: batch {batch} {name} {rate:.1f} tok/s", flush=True)
                best[(name, batch)] = max(best.get((name, batch), 0.0), rate)
        for name in names:
            ratio = best[(name, batch)] / best[(names[0], batch)]
            print(f"batch {batch:>3}  {name:<22} {best[(name, batch)]:8.1f} tok/s  x{ratio:.2f} vs {names[0]}", flush=True)


if __name__ == "__main__":
    main()
