"""W1 spread over LoRA adapters against W1 on the base model alone, side by side in one process; the time to swap
an adapter in.

    python -m benchmarks.lora_w1 [--adapters 8] [--rank 16] [--repeats 3] [--dtype auto]

The default model with ``--adapters`` adapters of rank ``--rank`` on all seven projections (written with PEFT at
start, random weights), all resident (``max_loras`` = ``--adapters``). W1 (32 seeded prompts, 64 greedy output
tokens each, EOS ignored): ``base`` on an engine without LoRA, ``base, LoRA on`` with no adapter on the engine that
serves them (its projections wrapped; decode steps fused, as the base's are), ``adapters`` with request ``i`` under
adapter ``i % N``; rounds alternate, best of ``--repeats``, output tokens/s and the ratio to ``base``, with the
spread over the rounds (each round's run over its own ``base``: a noisy machine slows a round's runs alike). Then
one more adapter swapped into a slot: from host memory (loaded before) and from its folder (read, checked and
copied in).

Target (the issue of LoRA serving): ``adapters`` at least 0.8x ``base`` with 8 rank-16 adapters.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.workload import make_workload

VOCAB_SIZE = 49152
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(base: Path, folder: Path, count: int, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for index in range(count):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank,
                                                      target_modules=MODULES))
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)
        path = folder / f"adapter-{index}"
        peft_model.save_pretrained(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.default_model import ensure_default_model
    from pdserve.engine.types.lora import LoRARequest

    base = ensure_default_model()
    with tempfile.TemporaryDirectory() as folder:
        paths = write_adapters(base, Path(folder), args.adapters + 1, args.rank)
        requests = [LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(paths)]
        llm = LLM(model=str(base), dtype=args.dtype, enable_prefix_caching=False, enable_lora=True,
                  max_loras=args.adapters, max_lora_rank=args.rank, max_cpu_loras=args.adapters + 1)
        plain = LLM(model=str(base), dtype=args.dtype, enable_prefix_caching=False)  # LoRA off
        w1 = make_workload(32, 32, 256, 64, VOCAB_SIZE, 0)
        prompts = w1.prompt_lists()
        greedy = SamplingParams(max_tokens=w1.output_len, temperature=0.0, ignore_eos=True)
        spread = [requests[i % args.adapters] for i in range(len(prompts))]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), spread[:2])  # warm-up
        plain.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))
        rounds: dict[str, list[float]] = {"base": [], "base, LoRA on": [], "adapters": []}
        for _ in range(args.repeats):
            for name, engine, loras in (("base", plain, None), ("base, LoRA on", llm, None), ("adapters", llm, spread)):
                start = time.perf_counter()
                outputs = engine.generate(prompts, greedy, loras)
                seconds = time.perf_counter() - start
                rounds[name].append(sum(len(out.token_ids) for out in outputs) / seconds)
        best = {name: max(rates) for name, rates in rounds.items()}
        manager = llm.engine.lora
        assert manager is not None
        spare = requests[-1]
        start = time.perf_counter()
        slot = manager.acquire(spare)  # read from its folder, checked, copied into the least recently used slot
        from_disk = time.perf_counter() - start
        assert slot is not None
        manager.release(slot)
        # Every other adapter used once more, twice over: the spare becomes the least recently used and is swapped
        # out (it stays loaded in host memory: max_cpu_loras holds all of them).
        for request in requests[:-1] * 2:
            used = manager.acquire(request)
            assert used is not None
            manager.release(used)
        assert spare.lora_name not in manager.resident()
        start = time.perf_counter()
        again = manager.acquire(spare)
        from_host = time.perf_counter() - start
        assert again is not None
        manager.release(again)
    print(f"W1: {len(prompts)} prompts x {w1.output_len} tokens; {args.adapters} adapters of rank {args.rank} on "
          f"{', '.join(MODULES)}; dtype {llm.engine.dtype}; best of {args.repeats}")
    print("| run | output tok/s | x base | rounds: tok/s | rounds: x that round's base |")
    for name, rate in best.items():
        ratios = [r / b for r, b in zip(rounds[name], rounds["base"])]
        print(f"| {name} | {rate:.1f} | {rate / best['base']:.3f} | {min(rounds[name]):.1f}-{max(rounds[name]):.1f} "
              f"| {min(ratios):.3f}-{max(ratios):.3f} |")
    print(f"swap in: from its folder {from_disk * 1e3:.1f} ms, from host memory {from_host * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
