"""Side-by-side timings of the engine's two CPU hot paths: the projections and decode attention.

    python -m benchmarks.decode_step [--batch 32] [--steps-before 40] [--repeats 12] [--json out.json]
        [--dtype float32] [--quantization int4] [--kv-cache-dtype int8] [--skip-linear] [--threads 2]
        [--profile 20]

1. Linear layers: every distinct weight shape of the model at the decode batch
   size and at a 2,048-token prefill step, as ``F.linear`` on the checkpoint's
   separate matrices against the engine's ``PackedLinear`` (q/k/v and gate/up
   fused, MKL packed GEMM format), timed alternately in this process.
2. A whole decode step of the embedded default model at batch ``--batch``
   (after ``--steps-before`` steps of the offline workload, so contexts are
   mid-run), alternating the attention backend on the same scheduled step:
   ``sdpa`` (gather the blocks into a padded batch, SDPA) and ``cpu_paged``
   (the C kernel reading the block pool in place, its work split by OpenMP on
   torch's own threads). Where the engine runs the step through the
   fused decode step (a bf16 INT8/INT4 model, a batch up to its cut-off:
   pdserve/engine/models/fused_decode.py), ``cpu_paged`` is that step and
   ``cpu_paged_eager`` the same step layer by layer (``enforce_eager``).
   ``--profile N`` then prints torch.profiler's table of the N costliest ops of
   one ``cpu_paged`` step (self CPU time).

The minimum of ``--repeats`` alternating runs is reported, with the median;
the machine is shared, so only figures from one run compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
from torch import nn

from benchmarks.workload import make_workload
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.cpu_kernel import load_paged_attention_kernel
from pdserve.engine.attention.sdpa import SdpaBackend
from pdserve.engine.models.llama import PackedLinear

VOCAB_SIZE = 49152


def _alternate(candidates: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Each candidate run once per round, rounds repeated; min and median milliseconds."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in candidates.items():
            started = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: {"min_ms": min(t), "median_ms": statistics.median(t)} for name, t in times.items()}


def linear_layers(hidden: int, intermediate: int, q_out: int, kv_out: int, batch: int, repeats: int) -> list[dict]:
    """F.linear on separate matrices against one PackedLinear, per projection group and batch size."""
    torch.manual_seed(0)
    groups = {
        "q/k/v": (hidden, [q_out, kv_out, kv_out]),
        "o": (q_out, [hidden]),
        "gate/up": (hidden, [intermediate, intermediate]),
        "down": (intermediate, [hidden]),
    }
    rows = []
    with torch.inference_mode():
        for num_tokens in (batch, 2048):
            for name, (in_features, outs) in groups.items():
                linears = [nn.Linear(in_features, out, bias=False) for out in outs]
                packed = PackedLinear(linears)
                x = torch.randn(num_tokens, in_features)
                result = _alternate(
                    {
                        "F.linear": lambda: [nn.functional.linear(x, lin.weight) for lin in linears],
                        "PackedLinear": lambda: packed(x),
                    },
                    repeats,
                )
                rows.append({"tokens": num_tokens, "projection": name, **result})
    return rows


def decode_step(batch: int, steps_before: int, repeats: int, profile_rows: int = 0, **engine_args: object) -> dict:
    llm = LLM(**engine_args)
    engine = llm.engine
    workload = make_workload(batch, 32, 256, 64, VOCAB_SIZE, 0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for prompt in workload.prompt_lists():
        engine.add_request(prompt, params)
    for _ in range(steps_before):
        engine.step()
    scheduled = engine.scheduler.schedule()
    decodes = [item for item in scheduled.scheduled if item.is_decode]
    if len(decodes) != len(scheduled.scheduled):
        raise SystemExit("the timed step still holds prefill chunks: raise --steps-before")
    context = statistics.mean(item.start + 1 for item in decodes)
    backends = {"sdpa": SdpaBackend()}
    kernel = load_paged_attention_kernel()
    if kernel is not None:
        backends["cpu_paged"] = SdpaBackend(kernel)

    fused_decoder = engine.model.fused_decoder

    def run_with(backend: SdpaBackend, fused: bool = True) -> Callable[[], object]:
        def run() -> object:
            # Re-running one scheduled step rewrites the same cache slots with the same values.
            engine.runner.backend = backend
            engine.model.fused_decoder = fused_decoder if fused else None
            return engine.runner.execute(scheduled)

        return run

    candidates = {name: run_with(backend) for name, backend in backends.items()}
    if fused_decoder is not None and "cpu_paged" in backends:
        candidates["cpu_paged_eager"] = run_with(backends["cpu_paged"], fused=False)
    result = _alternate(candidates, repeats)
    engine.model.fused_decoder = fused_decoder
    if profile_rows:
        engine.runner.backend = backends.get("cpu_paged", backends["sdpa"])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            engine.runner.execute(scheduled)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=profile_rows))
    return {"batch": len(decodes), "mean_context": context, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps-before", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtype", default="float32", help="the engine's dtype for the step (default float32)")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8"])
    parser.add_argument("--skip-linear", action="store_true", help="time the decode step only")
    parser.add_argument("--num-kv-blocks", type=int, default=1024, help="KV pool size (default: room for the batch)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest ops of one step")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    linear = []
    if not args.skip_linear:
        # SmolLM2-135M's shapes: hidden 576, intermediate 1536, 9 query heads and 3 KV heads of 64.
        linear = linear_layers(576, 1536, 576, 192, args.batch, args.repeats * 4)
        print(f"{'tokens':>6}  {'projection':<8}  {'F.linear ms':>11}  {'PackedLinear ms':>15}  speed-up (min)")
        for row in linear:
            old, new = row["F.linear"]["min_ms"], row["PackedLinear"]["min_ms"]
            print(f"{row['tokens']:>6}  {row['projection']:<8}  {old:>11.3f}  {new:>15.3f}  {old / new:.2f}x")
    step = decode_step(
        args.batch, args.steps_before, args.repeats, args.profile,
        dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        num_kv_blocks=args.num_kv_blocks,
    )
    setting = f"{args.dtype}, quantization {args.quantization}, KV {args.kv_cache_dtype}"
    print(f"\ndecode step ({setting}), batch {step['batch']}, mean context {step['mean_context']:.0f} tokens:")
    print(f"  {torch.get_num_threads()} torch thread(s)")
    for name in ("sdpa", "cpu_paged", "cpu_paged_eager"):
        if name in step:
            print(f"  {name:<14} min {step[name]['min_ms']:.1f} ms, median {step[name]['median_ms']:.1f} ms")
    for name in ("sdpa", "cpu_paged_eager"):
        if "cpu_paged" in step and name in step:
            print(f"  cpu_paged / {name} (min): {step['cpu_paged']['min_ms'] / step[name]['min_ms']:.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"linear": linear, "decode_step": step}, out, indent=2)


if __name__ == "__main__":
    main()
