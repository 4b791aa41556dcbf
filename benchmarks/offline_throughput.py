"""Offline throughput: pdserve's ``LLM.generate`` against Hugging Face transformers, and against the machine.

Run ``python -m benchmarks.offline_throughput --help``; benchmarks/README.md
explains each printed figure. Every system runs in this one process on the same
prompts, greedy, float32, with EOS ignored, and is timed after a short warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks.hf_baselines import continuous_batching_config, load_hf_model, run_hf_continuous, run_hf_static
from benchmarks.machine_limits import MachineLimits, measure_machine_limits
from benchmarks.pdserve_runner import PdserveSettings, run_pdserve
from benchmarks.roofline import decode_step_bound, model_cost, prefill_bound, whole_run_bound
from benchmarks.workload import RunResult, compare_outputs, make_warmup_workload, make_workload, timed

PDSERVE = "pdserve"
PDSERVE_PREFILL_ONLY = "pdserve_prefill_only"
HF_STATIC = "hf_static"
HF_CONTINUOUS = "hf_continuous"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-prompts", type=int, default=32)
    workload.add_argument("--min-len", type=int, default=32, help="shortest prompt, in tokens")
    workload.add_argument("--max-len", type=int, default=256, help="longest prompt, in tokens")
    workload.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt")
    workload.add_argument("--seed", type=int, default=0, help="seeds the prompts' lengths and token ids")
    engine = parser.add_argument_group("pdserve engine")
    engine.add_argument("--model", default=None, help="model folder or hub id; default: the embedded SmolLM2-135M")
    engine.add_argument("--block-size", type=int, default=16, help="KV block size; also HF's page_size")
    engine.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from free memory")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="per-step token budget; also HF's max_batch_tokens"
    )
    engine.add_argument("--no-prefix-caching", action="store_true")
    baselines = parser.add_argument_group("baselines and parts to skip")
    baselines.add_argument("--static-batch-size", type=int, default=8)
    baselines.add_argument("--skip-pdserve", action="store_true")
    baselines.add_argument("--skip-hf-static", action="store_true")
    baselines.add_argument("--skip-hf-cb", action="store_true", help="skip transformers' generate_batch")
    baselines.add_argument("--skip-machine-limits", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_path = _model_path(args.model)
    hf_model, hf_load_s = timed(lambda: load_hf_model(model_path))
    vocab_size = hf_model.config.vocab_size
    workload = make_workload(args.num_prompts, args.min_len, args.max_len, args.output_len, vocab_size, args.seed)
    warmup = make_warmup_workload(workload, vocab_size, args.seed)

    results: dict[str, RunResult] = {}
    errors: dict[str, str] = {}
    if not args.skip_pdserve:
        settings = PdserveSettings(
            model=args.model,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
        )
        _run_into(results, errors, PDSERVE, lambda: run_pdserve(settings, workload, warmup, name=PDSERVE))
        if args.output_len > 1 and PDSERVE in results:
            prefill_workload = dataclasses.replace(workload, output_len=1)
            _run_into(
                results,
                errors,
                PDSERVE_PREFILL_ONLY,
                lambda: run_pdserve(settings, prefill_workload, warmup, name=PDSERVE_PREFILL_ONLY),
            )
    if not args.skip_hf_static:
        run_hf_static(hf_model, warmup, args.static_batch_size)
        _run_into(results, errors, HF_STATIC, lambda: run_hf_static(hf_model, workload, args.static_batch_size))
    if not args.skip_hf_cb:
        cb_settings = dict(
            page_size=args.block_size,
            max_batch_tokens=args.max_num_batched_tokens,
            max_requests_per_batch=args.max_num_seqs,
        )

        def run_continuous() -> RunResult:
            run_hf_continuous(hf_model, warmup, continuous_batching_config(warmup, **cb_settings))
            return run_hf_continuous(hf_model, workload, continuous_batching_config(workload, **cb_settings))

        _run_into(results, errors, HF_CONTINUOUS, run_continuous)

    limits = None if args.skip_machine_limits else measure_machine_limits()
    report = build_report(args, workload, results, errors, limits, hf_model, hf_load_s)
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return report


def _model_path(model: str | None) -> str | Path:
    """The folder both systems load: pdserve resolves ``None`` to this same converted checkpoint."""
    if model is None:
        from engine.default_model import ensure_default_model

        return ensure_default_model()
    return model


def _run_into(results: dict[str, RunResult], errors: dict[str, str], name: str, run: Any) -> None:
    """Run one system; a crash is recorded with its traceback and the other systems still run."""
    try:
        results[name] = run()
    except Exception:
        errors[name] = traceback.format_exc()
        print(f"[{name}] failed:\n{errors[name]}", file=sys.stderr, flush=True)


def build_report(
    args: argparse.Namespace,
    workload: Any,
    results: dict[str, RunResult],
    errors: dict[str, str],
    limits: MachineLimits | None,
    hf_model: Any,
    hf_load_s: float,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "hf_model_load_s": hf_load_s,
        },
        "workload": {
            "num_prompts": len(workload.prompts),
            "prompt_tokens": workload.num_prompt_tokens,
            "mean_prompt_len": workload.mean_prompt_len,
            "min_prompt_len": min(len(p) for p in workload.prompts),
            "max_prompt_len": max(len(p) for p in workload.prompts),
            "output_len": workload.output_len,
        },
        "results": {name: result.summary() for name, result in results.items()},
        "errors": errors,
        "ratios": {},
        "agreement": {},
    }
    pdserve = results.get(PDSERVE)
    for baseline in (HF_STATIC, HF_CONTINUOUS):
        if pdserve is not None and baseline in results:
            report["ratios"][f"{PDSERVE}/{baseline}"] = pdserve.output_tokens_per_s / results[baseline].output_tokens_per_s
            report["agreement"][f"{PDSERVE}_vs_{baseline}"] = compare_outputs(pdserve, results[baseline]).summary()
    if HF_STATIC in results and HF_CONTINUOUS in results:
        report["agreement"][f"{HF_STATIC}_vs_{HF_CONTINUOUS}"] = compare_outputs(
            results[HF_STATIC], results[HF_CONTINUOUS]
        ).summary()
    if limits is not None:
        report["machine_limits"] = limits.summary()
        if pdserve is not None:
            cost = model_cost(hf_model)
            report["whole_run_bound"] = whole_run_bound(cost, workload, limits, pdserve)
            prefill_only = results.get(PDSERVE_PREFILL_ONLY)
            if prefill_only is not None:
                report["prefill_bound"] = prefill_bound(cost, workload, limits, prefill_only)
                batch_size = min(len(workload.prompts), args.max_num_seqs)
                report["decode_step_bound"] = decode_step_bound(
                    cost, workload, limits, batch_size, pdserve, prefill_only
                )
    return report


_LABELS = {
    PDSERVE: "pdserve LLM.generate",
    PDSERVE_PREFILL_ONLY: "pdserve, output_len=1 (prefill)",
    HF_STATIC: "HF generate, static batches",
    HF_CONTINUOUS: "HF generate_batch (continuous)",
}


def print_report(report: dict[str, Any]) -> None:
    w, env = report["workload"], report["environment"]
    print(
        f"\nWorkload: {w['num_prompts']} prompts of {w['min_prompt_len']}..{w['max_prompt_len']} random tokens "
        f"(mean {w['mean_prompt_len']:.1f}, {w['prompt_tokens']} in all), {w['output_len']} output tokens each; "
        f"greedy, float32, EOS ignored"
    )
    print(f"torch {env['torch']}, transformers {env['transformers']}, {env['torch_threads']} torch threads\n")
    print(f"{'system':<34}{'wall s':>9}{'out tokens':>12}{'tok/s':>10}{'setup s':>9}")
    for name, result in report["results"].items():
        print(
            f"{_LABELS[name]:<34}{result['wall_s']:>9.2f}{result['output_tokens']:>12}"
            f"{result['output_tokens_per_s']:>10.1f}{result['setup_s']:>9.2f}"
        )
    for name, error in report["errors"].items():
        print(f"{_LABELS[name]:<34} FAILED: {error.strip().splitlines()[-1]}")
    for key, ratio in report["ratios"].items():
        print(f"throughput ratio {key}: {ratio:.2f}x")

    if report["agreement"]:
        print("\nGreedy token agreement (prompts whose outputs are identical; mean share of tokens before divergence)")
        for key, agreement in report["agreement"].items():
            print(
                f"  {key:<34}{agreement['num_identical']:>4}/{agreement['num_prompts']} = "
                f"{agreement['identical_fraction']:.1%}   common prefix {agreement['mean_common_prefix_fraction']:.1%}"
            )

    limits = report.get("machine_limits")
    if limits is None:
        return
    print(f"\nMachine limits (best of repeats, {limits['num_threads']} threads)")
    for shape, gflops in limits["matmul_gflops"].items():
        print(f"  float32 matmul {shape:<26}{gflops:>8.1f} GFLOP/s")
    print(f"  copy 512 MiB (read + write bytes)      {limits['copy_gbps_read_plus_write']:>8.1f} GB/s")
    print(f"  sum 512 MiB (read bytes)               {limits['sum_gbps_read']:>8.1f} GB/s")

    run = report.get("whole_run_bound")
    if run is not None:
        print(
            f"\nWhole pdserve run: 2 x {run['compute_params'] / 1e6:.1f}M params x "
            f"({run['prompt_tokens']} + {run['output_tokens']}) tokens = {run['flops'] / 1e12:.3f} TFLOP"
        )
        print(
            f"  compute bound {run['compute_bound_s']:.2f} s vs measured {run['measured_s']:.2f} s "
            f"-> {run['fraction_of_bound']:.1%} of the bound"
        )
        print(
            f"  (counting only needed FLOPs, attention included: {run['exact_flops'] / 1e12:.3f} TFLOP, "
            f"bound {run['exact_compute_bound_s']:.2f} s -> {run['exact_fraction_of_bound']:.1%})"
        )
    prefill = report.get("prefill_bound")
    if prefill is not None:
        print(
            f"Prefill-only pdserve run: {prefill['flops'] / 1e12:.3f} TFLOP, compute bound "
            f"{prefill['compute_bound_s']:.2f} s vs measured {prefill['measured_s']:.2f} s "
            f"-> {prefill['fraction_of_bound']:.1%}"
        )
    decode = report.get("decode_step_bound")
    if decode is not None:
        print(
            f"Decode step at batch {decode['batch_size']}, mean context {decode['mean_context_len']:.1f}: "
            f"weights {decode['weight_bytes'] / 1e6:.0f} MB + KV {decode['kv_bytes'] / 1e6:.0f} MB "
            f"({decode['kv_bytes_per_token']} B/token)"
        )
        print(
            f"  memory bound {decode['memory_bound_s'] * 1e3:.1f} ms, compute bound "
            f"{decode['compute_bound_s'] * 1e3:.1f} ms; measured (full - prefill-only) / (output_len - 1) = "
            f"{decode['measured_step_s'] * 1e3:.1f} ms"
        )
        print(
            f"  -> {decode['fraction_of_memory_bound']:.1%} of the memory bound, "
            f"{decode['fraction_of_roofline_bound']:.1%} of the larger (roofline) bound"
        )


if __name__ == "__main__":
    main()
