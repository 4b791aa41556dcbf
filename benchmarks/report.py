"""The benchmark's report: every figure as one JSON-ready dict, and its printed form."""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks.machine_limits import MachineLimits
from benchmarks.roofline import decode_step_bound, model_cost, prefill_bound, whole_run_bound
from benchmarks.workload import RunResult, Workload, compare_outputs

PDSERVE = "pdserve"
PDSERVE_PREFILL_ONLY = "pdserve_prefill_only"
HF_STATIC = "hf_static"
HF_CONTINUOUS = "hf_continuous"

_LABELS = {
    PDSERVE: "pdserve LLM.generate",
    PDSERVE_PREFILL_ONLY: "pdserve, output_len=1 (prefill)",
    HF_STATIC: "HF generate, static batches",
    HF_CONTINUOUS: "HF generate_batch (continuous)",
}


def build_report(
    config: dict[str, Any],
    workload: Workload,
    results: dict[str, RunResult],
    errors: dict[str, str],
    limit_measurements: list[MachineLimits],
    hf_model: Any,
    hf_load_s: float,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in config.items()},
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "device": _device_name(str(config.get("device", "cpu"))),
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
            ratio = pdserve.output_tokens_per_s / results[baseline].output_tokens_per_s
            report["ratios"][f"{PDSERVE}/{baseline}"] = ratio
            report["agreement"][f"{PDSERVE}_vs_{baseline}"] = compare_outputs(pdserve, results[baseline]).summary()
    if HF_STATIC in results and HF_CONTINUOUS in results:
        agreement = compare_outputs(results[HF_STATIC], results[HF_CONTINUOUS])
        report["agreement"][f"{HF_STATIC}_vs_{HF_CONTINUOUS}"] = agreement.summary()

    if not limit_measurements:
        return report
    limits = functools.reduce(MachineLimits.best_of, limit_measurements)
    report["machine_limits"] = {**limits.summary(), "measurements": [m.summary() for m in limit_measurements]}
    if pdserve is None:
        return report
    cost = model_cost(hf_model)
    report["whole_run_bound"] = whole_run_bound(cost, workload, limits, pdserve)
    prefill_only = results.get(PDSERVE_PREFILL_ONLY)
    if prefill_only is not None:
        report["prefill_bound"] = prefill_bound(cost, workload, limits, prefill_only)
        batch_size = min(len(workload.prompts), config["max_num_seqs"])
        report["decode_step_bound"] = decode_step_bound(cost, workload, limits, batch_size, pdserve, prefill_only)
    return report


def print_report(report: dict[str, Any]) -> None:
    _print_throughput(report)
    _print_agreement(report)
    _print_limits(report)


def _print_throughput(report: dict[str, Any]) -> None:
    w, env = report["workload"], report["environment"]
    print(
        f"\nWorkload: {w['num_prompts']} prompts of {w['min_prompt_len']}..{w['max_prompt_len']} random tokens "
        f"(mean {w['mean_prompt_len']:.1f}, {w['prompt_tokens']} in all), {w['output_len']} output tokens each; "
        f"greedy, {report['config'].get('dtype', 'float32')}, EOS ignored"
    )
    print(
        f"torch {env['torch']}, transformers {env['transformers']}, {env['torch_threads']} torch threads, "
        f"on {env['device']}\n"
    )
    print(f"{'system':<34}{'wall s':>9}{'out tokens':>12}{'tok/s':>10}{'setup s':>9}")
    for name, result in report["results"].items():
        print(
            f"{_LABELS[name]:<34}{result['wall_s']:>9.2f}{result['output_tokens']:>12}"
            f"{result['output_tokens_per_s']:>10.1f}{result['setup_s']:>9.2f}"
        )
    for name, error in report["errors"].items():
        print(f"{_LABELS[name]:<34} FAILED: {error.strip().splitlines()[-1]}")
    for key, ratio in report["ratios"].items():
        print(f"output tokens/s, {key}: {ratio:.2f}x")


def _print_agreement(report: dict[str, Any]) -> None:
    if not report["agreement"]:
        return
    print("\nGreedy agreement: prompts whose generated tokens are identical; mean share of tokens before divergence")
    for key, agreement in report["agreement"].items():
        print(
            f"  {key:<32}{agreement['num_identical']:>4}/{agreement['num_prompts']} = "
            f"{agreement['identical_fraction']:>6.1%}   common prefix {agreement['mean_common_prefix_fraction']:.1%}"
        )


def _print_limits(report: dict[str, Any]) -> None:
    limits = report.get("machine_limits")
    if limits is None:
        return
    print(
        f"\nMachine limits ({limits['num_threads']} threads; best of many repeats, "
        f"measured before and after the systems ran)"
    )
    for shape, gflops in limits["matmul_gflops"].items():
        print(f"  float32 matmul {shape:<26}{gflops:>8.1f} GFLOP/s")
    print(f"  copy 512 MiB (read + write bytes)       {limits['copy_gbps_read_plus_write']:>8.1f} GB/s")
    print(f"  sum 512 MiB (read bytes)                {limits['sum_gbps_read']:>8.1f} GB/s")

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
            f"  (needed FLOPs only, attention included: {run['exact_flops'] / 1e12:.3f} TFLOP, "
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
            f"Decode step at batch {decode['batch_size']}, mean context {decode['mean_context_len']:.1f} tokens: "
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


def _device_name(device: str) -> str:
    """``cpu``, or the GPU's own name (``cuda:0 (NVIDIA H200)``)."""
    if not device.startswith("cuda"):
        return device
    return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
