"""Decode attention and the decode step per KV cache dtype (float32, bfloat16, int8), side by side.

    python -m benchmarks.kv_cache_dtypes [--batch 32] [--steps-before 40] [--repeats 12] [--json out.json]

1. The C paged decode kernel alone over all 30 layers of SmolLM2-135M's shape
   (3 KV heads of 64, 9 query heads, 16-token blocks) at batch ``--batch``
   with the contexts of the offline workload mid-run, per KV dtype: a whole
   decode step's attention, its KV streamed from memory as in the engine (one
   layer alone would stay in cache). The gather + SDPA path is timed on one
   layer and scaled x30 (it is too slow to time whole).
2. A whole decode step of the embedded default model (float32 weights) at
   batch ``--batch``, one engine per KV dtype, after ``--steps-before`` steps
   of the offline workload, alternating the engines on their scheduled step.

Every candidate runs once per round, rounds repeated; min and median reported.
The machine is shared: only figures from one run compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch

from benchmarks.decode_step import VOCAB_SIZE, _alternate
from benchmarks.workload import make_workload
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.backend import AttentionBatch
from pdserve.engine.attention.cpu_kernel import load_paged_attention_kernel
from pdserve.engine.attention.sdpa import SdpaBackend
from pdserve.engine.kv.cache import KVCache, bytes_per_block

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
NUM_LAYERS, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 30, 3, 3, 64, 16


def _contexts(batch: int, steps_before: int) -> list[int]:
    workload = make_workload(batch, 32, 256, 64, VOCAB_SIZE, 0)
    return [len(prompt) + steps_before for prompt in workload.prompts]


def kernel_per_dtype(batch: int, steps_before: int, repeats: int) -> dict:
    """One layer's decode attention per KV dtype: the C kernel and gather + SDPA."""
    kernel = load_paged_attention_kernel()
    if kernel is None:
        raise SystemExit("the kernel is not in this package (built with PDSERVE_BUILD_KERNELS=0?)")
    lens = _contexts(batch, steps_before)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 1
    torch.manual_seed(0)
    tables, next_block = [], 1
    for n in lens:
        count = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    query = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM)
    values = torch.randn(NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    candidates: dict[str, Callable[[], object]] = {}
    for name, dtype in KV_DTYPES.items():
        cache = KVCache(NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))
        cache.import_blocks(range(num_blocks), values)  # quantized or cast on import
        layers = cache.layers()
        key_cache, value_cache = layers[0]
        for backend in (SdpaBackend(kernel), SdpaBackend()):
            batch_description = AttentionBatch(
                num_decodes=batch, query_lens=[1] * batch, context_lens=lens, block_tables=tables,
                slot_mapping=torch.zeros(batch, dtype=torch.long), block_size=BLOCK_SIZE, device=torch.device("cpu"),
                num_heads=NUM_KV_HEADS * GROUP, num_kv_heads=NUM_KV_HEADS,
            )
            metadata = backend.build_metadata(batch_description)
            if backend.kernel is not None:
                out = torch.empty_like(query)

                def run(layers=layers, m=metadata, out=out) -> object:
                    return [kernel(query, k, v, m.kernel_plan, HEAD_DIM**-0.5, out) for k, v in layers]
            else:
                def run(k=key_cache, v=value_cache, m=metadata, b=backend) -> object:
                    # forward() also writes the (zero-slot) new K/V first: the same small cost in every dtype.
                    return b.forward(query, query[:, :NUM_KV_HEADS], query[:, :NUM_KV_HEADS], k, v, m)
            candidates[f"{backend.name}/{name}"] = run
    result = _alternate(candidates, repeats)
    tokens = sum(lens)
    for name in KV_DTYPES:  # one layer timed: scale to a step
        result[f"sdpa/{name}"] = {key: value * NUM_LAYERS for key, value in result[f"sdpa/{name}"].items()}
    kv_bytes = {
        name: tokens * bytes_per_block(NUM_LAYERS, 1, NUM_KV_HEADS, HEAD_DIM, dtype) for name, dtype in KV_DTYPES.items()
    }
    return {"batch": batch, "mean_context": statistics.mean(lens), "kv_bytes_per_step": kv_bytes, **result}


def decode_step_per_dtype(batch: int, steps_before: int, repeats: int) -> dict:
    engines = {}
    scheduled = {}
    workload = make_workload(batch, 32, 256, 64, VOCAB_SIZE, 0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for name in KV_DTYPES:
        engine = LLM(dtype="float32", kv_cache_dtype="auto" if name == "float32" else name,
                     num_kv_blocks=batch * 24).engine
        for prompt in workload.prompt_lists():
            engine.add_request(prompt, params)
        for _ in range(steps_before):
            engine.step()
        step = engine.scheduler.schedule()
        if any(not item.is_decode for item in step.scheduled):
            raise SystemExit("the timed step still holds prefill chunks: raise --steps-before")
        engines[name], scheduled[name] = engine, step

    def run_with(name: str) -> Callable[[], object]:
        # Re-running one scheduled step rewrites the same cache slots with the same values.
        return lambda: engines[name].runner.execute(scheduled[name])

    result = _alternate({name: run_with(name) for name in KV_DTYPES}, repeats)
    backends = {name: engine.runner.backend.name for name, engine in engines.items()}
    return {"batch": batch, "backends": backends, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps-before", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--skip-step", action="store_true", help="time the kernel only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    kernel = kernel_per_dtype(args.batch, args.steps_before, args.repeats)
    print(f"decode attention of a whole step ({NUM_LAYERS} layers), batch {kernel['batch']}, mean context "
          f"{kernel['mean_context']:.0f}, {torch.get_num_threads()} threads:")
    base = kernel["cpu_paged/float32"]["min_ms"]
    for name in KV_DTYPES:
        for backend in ("cpu_paged", "sdpa"):
            row = kernel[f"{backend}/{name}"]
            mb = kernel["kv_bytes_per_step"][name] / 1e6
            print(f"  {backend:<9} {name:<8} KV {mb:6.2f} MB  min {row['min_ms']:7.3f} ms  median "
                  f"{row['median_ms']:7.3f} ms  {mb / row['min_ms']:5.2f} GB/s  vs cpu_paged/float32 "
                  f"{row['min_ms'] / base:.2f}")
    output = {"kernel": kernel}
    if not args.skip_step:
        step = decode_step_per_dtype(args.batch, args.steps_before, args.repeats)
        print(f"\ndecode step of the default model (float32 weights), batch {step['batch']}, by KV dtype:")
        for name in KV_DTYPES:
            row = step[name]
            print(f"  {name:<8} ({step['backends'][name]})  min {row['min_ms']:.1f} ms  median {row['median_ms']:.1f} ms"
                  f"  vs float32 {row['min_ms'] / step['float32']['min_ms']:.2f}")
        output["decode_step"] = step
    if args.json:
        with open(args.json, "w") as out:
            json.dump(output, out, indent=2)


if __name__ == "__main__":
    main()
