"""Speed and memory of each precision setting, side by side in one process, against float32.

``python -m benchmarks.precision_speed --setting bfloat16 --setting bfloat16:int4 ...``
(settings as in ``benchmarks/precision.py``; float32 always runs, first). For each
setting: W1 offline throughput (the ``offline_throughput`` workload), the prefill-only
pass, batch-1 decode tokens/s, weight and KV memory, and the decode step at the W1
batch against its own roofline bound (its bytes per weight and per KV element, and
the matmul rate of its compute dtype). The step is timed directly: the W1 requests
are stepped through the engine and the median of ``--timed-steps`` steps in which
every one of them decodes is taken, at those steps' own mean context; the step
derived from W1 minus the prefill-only pass is printed beside it. Settings alternate within each repeat so a
noisy neighbour slows all of them alike; every figure is the best of ``--repeats``.
benchmarks/README.md explains each figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.machine_limits import MATMUL_SHAPES, MachineLimits, measure_machine_limits
from benchmarks.precision import PrecisionSetting, failure_line, parse_settings, with_llm
from benchmarks.roofline import ModelCost, decode_step_bound, model_cost, step_bound
from benchmarks.workload import RunResult, Workload, make_warmup_workload, make_workload, timed

# Rotary tables are buffers of the model but no weights: no step reads them whole.
NOT_WEIGHTS = ("rotary.cos", "rotary.sin")


@dataclasses.dataclass
class SettingFigures:
    """The best figures of one setting over the repeats."""

    w1_s: float = float("inf")
    prefill_s: float = float("inf")
    batch1_full_s: float = float("inf")
    batch1_prefill_s: float = float("inf")
    setup_s: float = float("inf")
    weight_memory_bytes: int = 0
    weight_bytes_read_per_step: int = 0
    kv_bytes_per_token: float = 0.0
    w1_token_ids: tuple[tuple[int, ...], ...] = ()
    # The median of the timed all-decode steps at the W1 batch, and the mean context they attended to.
    step_s: float = float("inf")
    step_context: float = 0.0

    def keep_best(self, other: SettingFigures) -> None:
        for name in ("w1_s", "prefill_s", "batch1_full_s", "batch1_prefill_s", "setup_s"):
            setattr(self, name, min(getattr(self, name), getattr(other, name)))
        if other.step_s < self.step_s:
            self.step_s, self.step_context = other.step_s, other.step_context
        self.weight_memory_bytes = other.weight_memory_bytes
        self.weight_bytes_read_per_step = other.weight_bytes_read_per_step
        self.kv_bytes_per_token = other.kv_bytes_per_token
        self.w1_token_ids = other.w1_token_ids or self.w1_token_ids


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes the model's weights occupy, bytes one decode step reads).

    Every parameter and buffer but the rotary tables, a tensor shared by two names
    counted once. A step reads all of them except the input embedding when a
    separate LM-head tensor exists (the lookup touches only the batch's rows).
    """
    seen: set[int] = set()
    total = embedding = 0
    has_lm_head = False
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(NOT_WEIGHTS) or tensor.data_ptr() in seen:
            continue  # a tied LM head sharing the embedding's storage lands here: read, but counted once
        seen.add(tensor.data_ptr())
        size = tensor.numel() * tensor.element_size()
        total += size
        if "embed_tokens" in name:
            embedding += size
        has_lm_head = has_lm_head or "lm_head" in name
    return total, total - embedding if has_lm_head else total


def kv_bytes_per_token(kv_cache: Any) -> float:
    """Every tensor the KV cache holds (values and any scales), per token slot of the pool."""
    tensors = [value for value in vars(kv_cache).values() if isinstance(value, torch.Tensor)]
    pool_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return pool_bytes / (kv_cache.num_blocks * kv_cache.block_size)


def measure_linear_gflops(dtype: torch.dtype, repeats: int = 8, min_time_s: float = 0.2) -> float:
    """``F.linear`` at the machine-limits MLP shape with the weight stored (out, in), as the engine stores it."""
    m, k, n = MATMUL_SHAPES[0]
    x = torch.randn(m, k).to(dtype)
    weight = torch.randn(n, k).to(dtype)
    F.linear(x, weight)
    best = 0.0
    for _ in range(repeats):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time_s or count == 0:
            F.linear(x, weight)
            count += 1
        best = max(best, 2 * m * k * n * count / elapsed / 1e9)
    return best


def time_decode_steps(engine: Any, workload: Workload, num_steps: int) -> tuple[float, float]:
    """(median seconds, mean context) of ``num_steps`` engine steps in which every W1 request decodes.

    The requests are stepped until one step gives each of them a token (the last
    prefill chunk done); each of the next ``num_steps`` steps must do the same.
    """
    batch = len(workload.prompts)
    for prompt in workload.prompt_lists():
        engine.add_request(prompt, _greedy(workload.output_len))
    while len(engine.step()) < batch:
        if not engine.has_unfinished_requests():
            raise RuntimeError("the W1 requests finished before all of them decoded in one step")
    times, contexts = [], []
    try:
        for _ in range(num_steps):
            running = engine.scheduler.running
            if len(running) != batch:
                raise RuntimeError(f"{len(running)} of {batch} requests left to decode: lower --timed-steps")
            # A decode step feeds each sequence's newest token, which attends to all of its tokens.
            contexts.append(statistics.mean(seq.num_tokens for seq in running))
            started = time.perf_counter()
            stepped = len(engine.step())
            times.append(time.perf_counter() - started)
            if stepped != batch:
                raise RuntimeError(f"a timed step decoded {stepped} of {batch} requests")
    finally:
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times), statistics.mean(contexts)


def run_setting(
    llm: Any, workload: Workload, warmup: Workload, batch1: Workload, timed_steps: int = 0
) -> SettingFigures:
    """One pass of every timed figure on one engine (prefix caching off, so repeated prompts recompute)."""
    llm.generate(warmup.prompt_lists(), _greedy(warmup.output_len))
    outputs, w1_s = timed(lambda: llm.generate(workload.prompt_lists(), _greedy(workload.output_len)))
    _, prefill_s = timed(lambda: llm.generate(workload.prompt_lists(), _greedy(1)))
    _, batch1_full_s = timed(lambda: llm.generate(batch1.prompt_lists(), _greedy(batch1.output_len)))
    _, batch1_prefill_s = timed(lambda: llm.generate(batch1.prompt_lists(), _greedy(1)))
    step_s, step_context = time_decode_steps(llm.engine, workload, timed_steps) if timed_steps else (float("inf"), 0.0)
    memory, read = weight_bytes(llm.engine.model)
    return SettingFigures(
        w1_s=w1_s,
        prefill_s=prefill_s,
        batch1_full_s=batch1_full_s,
        batch1_prefill_s=batch1_prefill_s,
        weight_memory_bytes=memory,
        weight_bytes_read_per_step=read,
        kv_bytes_per_token=kv_bytes_per_token(llm.engine.kv_cache),
        w1_token_ids=tuple(tuple(o.token_ids) for o in outputs),
        step_s=step_s,
        step_context=step_context,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--setting", action="append", default=[], metavar="DTYPE[:QUANTIZATION[:KV_CACHE_DTYPE[:LM_HEAD[:EXECUTION]]]]",
        help="a setting to time (repeatable), e.g. bfloat16, bfloat16:int8, bfloat16:int4:int8",
    )
    parser.add_argument("--model", default=None, help="model folder or hub id; default: the embedded SmolLM2-135M")
    parser.add_argument("--num-prompts", type=int, default=32, help="W1: prompts, all submitted at once")
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64, help="W1: tokens generated per prompt")
    parser.add_argument("--batch1-prompt-len", type=int, default=128)
    parser.add_argument("--batch1-output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timed-steps", type=int, default=24,
        help="all-decode steps at the W1 batch timed one by one, their median reported (0: none)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="alternating passes over the settings; best kept")
    parser.add_argument("--skip-machine-limits", action="store_true", help="no roofline bounds")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    args = parser.parse_args(argv)
    if args.output_len < 2 or args.batch1_output_len < 2:
        parser.error("--output-len and --batch1-output-len must be at least 2 (decode is timed past the first token)")
    if not 0 <= args.timed_steps <= args.output_len // 2:
        parser.error("--timed-steps must be between 0 and half of --output-len (every W1 request decodes in each)")
    try:
        args.settings = parse_settings(args.setting)
    except ValueError as error:
        parser.error(f"--setting: {error}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from benchmarks.hf_baselines import load_hf_model
    from benchmarks.offline_throughput import _model_path

    hf_model = load_hf_model(_model_path(args.model))
    cost = model_cost(hf_model)
    vocab_size = hf_model.config.vocab_size
    del hf_model
    workload = make_workload(args.num_prompts, args.min_len, args.max_len, args.output_len, vocab_size, args.seed)
    warmup = make_warmup_workload(workload, vocab_size, args.seed)
    batch1 = make_workload(
        1, args.batch1_prompt_len, args.batch1_prompt_len, args.batch1_output_len, vocab_size, args.seed + 1
    )
    limits: list[MachineLimits] = [] if args.skip_machine_limits else [measure_machine_limits()]
    figures: dict[PrecisionSetting, SettingFigures] = {}
    failures: dict[PrecisionSetting, str] = {}
    for repeat in range(args.repeats):
        for setting in args.settings:
            if setting in failures:
                continue
            try:
                start = time.perf_counter()

                def run(llm: Any) -> SettingFigures:
                    setup_s = time.perf_counter() - start  # construction, outside every timed figure
                    figures = run_setting(llm, workload, warmup, batch1, args.timed_steps)
                    return dataclasses.replace(figures, setup_s=setup_s)

                result_figures = with_llm(setting, run, model=args.model, enable_prefix_caching=False)
                figures.setdefault(setting, SettingFigures()).keep_best(result_figures)
                print(f"[{setting.name}] repeat {repeat + 1}: W1 {result_figures.w1_s:.2f} s", flush=True)
            except Exception as error:
                failures[setting] = failure_line(error)
                print(f"[{setting.name}] {failures[setting]}", file=sys.stderr, flush=True)
    if not args.skip_machine_limits:
        limits.append(measure_machine_limits())
    linear_gflops = {} if args.skip_machine_limits else {
        name: measure_linear_gflops(dtype) for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    report = build_report(args, cost, workload, batch1, figures, failures, limits, linear_gflops)
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return report


def build_report(
    args: argparse.Namespace,
    cost: ModelCost,
    workload: Workload,
    batch1: Workload,
    figures: dict[PrecisionSetting, SettingFigures],
    failures: dict[PrecisionSetting, str],
    limits: list[MachineLimits],
    linear_gflops: dict[str, float],
) -> dict[str, Any]:
    best_limits = None
    for measured in limits:
        best_limits = measured if best_limits is None else best_limits.best_of(measured)
    num_output_tokens = len(workload.prompts) * workload.output_len
    batch_size = len(workload.prompts)
    reference = figures.get(PrecisionSetting("float32"))
    kv_values_per_token = cost.num_layers * 2 * cost.num_kv_heads * cost.head_dim
    rows = []
    for setting in args.settings:
        row: dict[str, Any] = {"setting": setting.name}
        if setting not in figures:
            rows.append({**row, "error": failures.get(setting, "no figures")})
            continue
        f = figures[setting]
        batch1_step_s = (f.batch1_full_s - f.batch1_prefill_s) / (batch1.output_len - 1)
        row.update(
            w1_s=f.w1_s,
            w1_tokens_per_s=num_output_tokens / f.w1_s,
            prefill_s=f.prefill_s,
            prefill_tokens_per_s=workload.num_prompt_tokens / f.prefill_s,
            batch1_decode_tokens_per_s=1 / batch1_step_s,
            setup_s=f.setup_s,
            weight_memory_bytes=f.weight_memory_bytes,
            weight_bytes_read_per_step=f.weight_bytes_read_per_step,
            kv_bytes_per_token=f.kv_bytes_per_token,
        )
        if reference is not None:
            ref_step_s = (reference.batch1_full_s - reference.batch1_prefill_s) / (batch1.output_len - 1)
            row["w1_vs_float32"] = reference.w1_s / f.w1_s
            row["batch1_decode_vs_float32"] = ref_step_s / batch1_step_s
            same = sum(a == b for a, b in zip(reference.w1_token_ids, f.w1_token_ids))
            row["w1_greedy_same_as_float32"] = f"{same}/{len(f.w1_token_ids)} prompts"
        if best_limits is not None:
            setting_cost = dataclasses.replace(
                cost,
                weight_bytes_per_value=f.weight_bytes_read_per_step / cost.compute_params,
                kv_bytes_per_value=f.kv_bytes_per_token / kv_values_per_token,
            )
            # float32 at the machine's best float32 rate, as offline_throughput; the others at bf16 F.linear's.
            gflops = (
                best_limits.best_gflops if setting.dtype == "float32" and setting.quantization is None
                else max(linear_gflops["bfloat16"], best_limits.best_gflops)
            )
            w1 = RunResult(name="w1", wall_s=f.w1_s, token_ids=())
            prefill = RunResult(name="prefill", wall_s=f.prefill_s, token_ids=())
            row["decode_step_from_w1"] = decode_step_bound(
                setting_cost, workload, best_limits, batch_size, w1, prefill, gflops
            )
            if f.step_context:
                row["decode_step"] = step_bound(setting_cost, best_limits, batch_size, f.step_context, f.step_s, gflops)
            for step in (row.get("decode_step"), row["decode_step_from_w1"]):
                if step is not None:
                    step["gflops"] = gflops
        rows.append(row)
    return {
        "workload": {
            "num_prompts": len(workload.prompts),
            "prompt_tokens": workload.num_prompt_tokens,
            "output_len": workload.output_len,
            "batch1_prompt_len": args.batch1_prompt_len,
            "batch1_output_len": args.batch1_output_len,
        },
        "repeats": args.repeats,
        "timed_steps": args.timed_steps,
        "machine_limits": best_limits.summary() if best_limits is not None else None,
        "linear_gflops": linear_gflops,
        "settings": rows,
    }


def print_report(report: dict[str, Any]) -> None:
    limits = report["machine_limits"]
    if limits is not None:
        print(
            f"\nmachine: {limits['best_gbps']:.1f} GB/s; F.linear (2048x576)->1536: "
            + ", ".join(f"{name} {gflops:.0f} GFLOP/s" for name, gflops in report["linear_gflops"].items())
        )
    print(
        f"\n{'setting':<20}{'W1 tok/s':>9}{'x fp32':>7}{'prefill tok/s':>14}{'b1 tok/s':>9}{'x fp32':>7}"
        f"{'weights MB':>11}{'KV B/tok':>9}{'step ms':>8}{'bound ms':>9}{'of bound':>9}"
        f"{'W1 step':>8}{'of bound':>9}  same greedy"
    )
    for row in report["settings"]:
        if "error" in row:
            print(f"{row['setting']:<20}  {row['error']}")
            continue
        step, w1_step = row.get("decode_step"), row.get("decode_step_from_w1")
        print(
            f"{row['setting']:<20}{row['w1_tokens_per_s']:>9.1f}{row.get('w1_vs_float32', float('nan')):>7.2f}"
            f"{row['prefill_tokens_per_s']:>14.0f}{row['batch1_decode_tokens_per_s']:>9.1f}"
            f"{row.get('batch1_decode_vs_float32', float('nan')):>7.2f}{row['weight_memory_bytes'] / 1e6:>11.1f}"
            f"{row['kv_bytes_per_token']:>9.0f}"
            + (
                f"{step['measured_step_s'] * 1e3:>8.1f}{step['roofline_bound_s'] * 1e3:>9.1f}"
                f"{step['fraction_of_roofline_bound']:>9.1%}" if step else f"{'-':>8}{'-':>9}{'-':>9}"
            )
            + (
                f"{w1_step['measured_step_s'] * 1e3:>8.1f}{w1_step['fraction_of_roofline_bound']:>9.1%}"
                if w1_step else ""
            )
            + f"  {row.get('w1_greedy_same_as_float32', '')}"
        )


def _greedy(max_tokens: int) -> Any:
    from pdserve.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


if __name__ == "__main__":
    main()
