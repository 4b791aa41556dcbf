"""Offline throughput: pdserve's ``LLM.generate`` against Hugging Face transformers, and against the machine.

Run ``python -m benchmarks.offline_throughput --help``; benchmarks/README.md
explains each printed figure. Every system runs in this one process on the same
prompts, greedy, with EOS ignored, and is timed after a short warm-up: float32 on
the CPU by default; ``--device cuda --dtype bfloat16`` runs every system on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from benchmarks.hf_baselines import continuous_batching_config, load_hf_model, run_hf_continuous, run_hf_static
from benchmarks.machine_limits import MachineLimits, measure_machine_limits
from benchmarks.pdserve_runner import PdserveSettings, run_pdserve
from benchmarks.report import (
    HF_CONTINUOUS,
    HF_STATIC,
    PDSERVE,
    PDSERVE_PREFILL_ONLY,
    build_report,
    print_report,
)
from benchmarks.workload import RunResult, Workload, make_warmup_workload, make_workload, timed


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
    engine.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="weights and activations of every system (default float32, the exactness oracle's)",
    )
    engine.add_argument(
        "--device", default="cpu",
        help="cpu or cuda[:N]: where every system runs; the machine limits are measured on the CPU only",
    )
    engine.add_argument("--block-size", type=int, default=16, help="KV block size; also HF's page_size")
    engine.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from free memory")
    engine.add_argument("--max-num-seqs", type=int, default=256, help="also HF's max_requests_per_batch")
    engine.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="per-step token budget; also HF's max_batch_tokens"
    )
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument(
        "--attention-backend", default="auto",
        help="auto (the C decode kernel, cpu_paged, where it builds), sdpa (pure torch), cpu_paged, flash_attn",
    )
    runs = parser.add_argument_group("baselines and what to run")
    runs.add_argument("--static-batch-size", type=int, default=8)
    runs.add_argument(
        "--repeats", type=int, default=1, help="timed runs per system; the fastest is reported (the machine is shared)"
    )
    runs.add_argument("--skip-pdserve", action="store_true")
    runs.add_argument("--skip-hf-static", action="store_true")
    runs.add_argument("--skip-hf-cb", action="store_true", help="skip transformers' continuous batching")
    runs.add_argument("--skip-machine-limits", action="store_true", help="implied by a --device other than cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.skip_machine_limits = not measures_machine_limits(args)
    hf_model, hf_load_s = timed(lambda: load_hf_model(_model_path(args.model), args.dtype, args.device))
    vocab_size = hf_model.config.vocab_size
    workload = make_workload(args.num_prompts, args.min_len, args.max_len, args.output_len, vocab_size, args.seed)
    warmup = make_warmup_workload(workload, vocab_size, args.seed)

    # Measured before and after the systems run; the better of the two is the limit.
    limit_measurements: list[MachineLimits] = []
    if not args.skip_machine_limits:
        limit_measurements.append(measure_machine_limits())
    results, errors = run_systems(args, hf_model, workload, warmup)
    if not args.skip_machine_limits:
        limit_measurements.append(measure_machine_limits())

    report = build_report(vars(args), workload, results, errors, limit_measurements, hf_model, hf_load_s)
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return report


def measures_machine_limits(args: argparse.Namespace) -> bool:
    """The limits, and the roofline built on them, are the CPU's matrix and memory rates: CPU runs only."""
    return not args.skip_machine_limits and args.device == "cpu"


def run_systems(
    args: argparse.Namespace, hf_model: Any, workload: Workload, warmup: Workload
) -> tuple[dict[str, RunResult], dict[str, str]]:
    """Each selected system's fastest timed run, and the traceback of any system that crashed."""
    results: dict[str, RunResult] = {}
    errors: dict[str, str] = {}

    def attempt(name: str, run: Callable[[], RunResult]) -> None:
        # A crash is recorded and reported; the other systems still run.
        try:
            results[name] = run()
        except Exception:
            errors[name] = traceback.format_exc()
            print(f"[{name}] failed:\n{errors[name]}", file=sys.stderr, flush=True)

    if not args.skip_pdserve:
        settings = PdserveSettings(
            model=args.model,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            attention_backend=args.attention_backend,
            dtype=args.dtype,
            device=args.device,
        )
        # run_pdserve builds a fresh engine and warms it up on every call.
        attempt(PDSERVE, lambda: fastest_of(args.repeats, lambda: run_pdserve(settings, workload, warmup)))
        if args.output_len > 1 and PDSERVE in results:
            prefill_workload = dataclasses.replace(workload, output_len=1)
            attempt(
                PDSERVE_PREFILL_ONLY,
                lambda: fastest_of(
                    args.repeats, lambda: run_pdserve(settings, prefill_workload, warmup, name=PDSERVE_PREFILL_ONLY)
                ),
            )

    if not args.skip_hf_static:

        def static() -> RunResult:
            run_hf_static(hf_model, warmup, args.static_batch_size)
            return fastest_of(args.repeats, lambda: run_hf_static(hf_model, workload, args.static_batch_size))

        attempt(HF_STATIC, static)

    if not args.skip_hf_cb:
        sizing = dict(
            page_size=args.block_size,
            max_batch_tokens=args.max_num_batched_tokens,
            max_requests_per_batch=args.max_num_seqs,
        )

        def continuous() -> RunResult:
            run_hf_continuous(hf_model, warmup, continuous_batching_config(warmup, **sizing))
            config = continuous_batching_config(workload, **sizing)
            return fastest_of(args.repeats, lambda: run_hf_continuous(hf_model, workload, config))

        attempt(HF_CONTINUOUS, continuous)
    return results, errors


def fastest_of(repeats: int, run: Callable[[], RunResult]) -> RunResult:
    """The fastest of ``repeats`` runs, every run's wall time kept in its details."""
    runs = [run() for _ in range(repeats)]
    fastest = min(runs, key=lambda result: result.wall_s)
    if repeats == 1:
        return fastest
    return dataclasses.replace(fastest, details={**fastest.details, "all_wall_s": [r.wall_s for r in runs]})


def _model_path(model: str | None) -> str | Path:
    """The checkpoint both systems load: pdserve resolves ``None`` to this same converted folder."""
    if model is None:
        from pdserve.engine.default_model import ensure_default_model

        return ensure_default_model()
    return model


if __name__ == "__main__":
    main()
