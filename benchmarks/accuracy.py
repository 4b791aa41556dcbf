"""Accuracy of reduced-precision settings against float32 of the same checkpoint.

``python -m benchmarks.accuracy --setting bfloat16 --setting bfloat16:int8 ...``:
perplexity over a fixed English text (``benchmarks/accuracy_text.py``), top-1
agreement and mean KL per token against float32 (``benchmarks/accuracy_metrics.py``
says how), all computed through the engine's ``prompt_logprobs``. float32 always
runs first, as the reference. A setting this checkout's engine cannot build is
reported as ``unsupported: <error>``. benchmarks/README.md explains each figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence as Seq

from benchmarks.accuracy_metrics import TopList, Window, agreement, perplexity, sliding_windows
from benchmarks.accuracy_text import load_token_ids
from benchmarks.precision import REFERENCE, PrecisionSetting, Unsupported, failure_line, parse_settings, with_llm

# Perplexity may rise at most this much over its reference (float32, or for an int8 KV
# cache the same weights with the KV in the model's dtype): the targets.
PERPLEXITY_TARGETS = {"bfloat16": 0.01, "float16": 0.01, "int8": 0.01, "int4": 0.05}
KV_INT8_TARGET = 0.005
BLOCK_SIZE = 16  # the engine's default


@dataclass(frozen=True)
class ScoredText:
    """One setting's pass over the text: per scored token, its logprob and the top-N list at its position."""

    logprobs: tuple[float, ...]
    tops: tuple[TopList, ...]
    wall_s: float


def score_text(
    llm: Any, token_ids: Seq[int], windows: Seq[Window], top_n: int, windows_at_once: int | None = None
) -> ScoredText:
    """Windows submitted ``windows_at_once`` at a time (all by default); ``max_tokens=1`` because only the
    prompt's logprobs matter. The figures do not depend on the grouping, only memory and time do."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(prompt_logprobs=top_n, max_tokens=1, temperature=0.0)
    prompts = [list(token_ids[w.begin : w.end]) for w in windows]
    group = windows_at_once or len(prompts)
    start = time.perf_counter()
    outputs = [out for i in range(0, len(prompts), group) for out in llm.generate(prompts[i : i + group], params)]
    wall_s = time.perf_counter() - start
    logprobs: list[float] = []
    tops: list[TopList] = []
    for w, output in zip(windows, outputs):
        entries = output.prompt_logprobs
        assert entries is not None and len(entries) == w.end - w.begin - 1, (w, entries and len(entries))
        for j in w.scored_entries():
            assert entries[j].token_id == token_ids[w.begin + j + 1]
            logprobs.append(entries[j].logprob)
            tops.append(entries[j].top)
    return ScoredText(tuple(logprobs), tuple(tops), wall_s)


def target_for(setting: PrecisionSetting) -> tuple[PrecisionSetting, float] | None:
    """(the setting perplexity is judged against, the largest relative rise allowed); None for the reference."""
    if setting.base is not None and setting.kv_cache_dtype == "int8":
        return setting.base, KV_INT8_TARGET
    if setting.quantization is not None:
        return PrecisionSetting(REFERENCE), PERPLEXITY_TARGETS[setting.quantization]
    if setting.dtype != REFERENCE:
        return PrecisionSetting(REFERENCE), PERPLEXITY_TARGETS[setting.dtype]
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--setting", action="append", default=[], metavar="DTYPE[:QUANTIZATION[:KV_CACHE_DTYPE[:LM_HEAD[:EXECUTION]]]]",
        help="a setting to judge (repeatable), e.g. bfloat16, bfloat16:int8, bfloat16:int4:int8, bfloat16::int8",
    )
    parser.add_argument("--model", default=None, help="model folder or hub id; default: the embedded SmolLM2-135M")
    parser.add_argument("--window", type=int, default=2048, help="tokens per window")
    parser.add_argument("--stride", type=int, default=2048, help="tokens between window starts")
    parser.add_argument("--top-n", type=int, default=20, help="prompt_logprobs=N: the top list KL is computed over")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens (quick runs)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=256,
        help="prefill chunk: every chunk after a window's first attends to its context as the KV cache holds it "
        "(a compact KV dtype's rounding shows only there, as it does in decode)",
    )
    parser.add_argument(
        "--windows-at-once", type=int, default=None,
        help="windows scored together (default: all); fewer keep the KV pool small on a machine short of memory",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    args = parser.parse_args(argv)
    if args.top_n < 1:
        parser.error(f"--top-n must be at least 1, got {args.top_n}")
    try:
        args.settings = parse_settings(args.setting)
    except ValueError as error:
        parser.error(f"--setting: {error}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    token_ids = load_token_ids(_tokenizer(args.model))
    if args.max_tokens is not None:
        token_ids = token_ids[: args.max_tokens]
    windows = sliding_windows(len(token_ids), args.window, args.stride)
    print(
        f"text: {len(token_ids)} tokens, {len(windows)} windows of {args.window} (stride {args.stride}), "
        f"{sum(w.num_scored for w in windows)} scored; KL over the top {args.top_n}",
        flush=True,
    )
    # A pool that holds every window in flight at once: no preemption, so no prompt position is recomputed.
    num_kv_blocks = min(len(windows), args.windows_at_once or len(windows)) * (-(-args.window // BLOCK_SIZE) + 1)
    scored: dict[PrecisionSetting, ScoredText] = {}
    failures: dict[PrecisionSetting, str] = {}
    for setting in args.settings:
        try:
            scored[setting] = with_llm(
                setting, lambda llm: score_text(llm, token_ids, windows, args.top_n, args.windows_at_once),
                model=args.model,
                max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
            )
            print(f"[{setting.name}] scored in {scored[setting].wall_s:.1f} s", flush=True)
        except Exception as error:
            failures[setting] = failure_line(error)
            print(f"[{setting.name}] {failures[setting]}", file=sys.stderr, flush=True)
            if not isinstance(error, Unsupported):
                traceback.print_exc()
    report = build_report(args, len(token_ids), windows, scored, failures)
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return report


def build_report(
    args: argparse.Namespace,
    num_tokens: int,
    windows: Seq[Window],
    scored: dict[PrecisionSetting, ScoredText],
    failures: dict[PrecisionSetting, str],
) -> dict[str, Any]:
    reference = scored.get(PrecisionSetting(REFERENCE))
    rows = []
    for setting in args.settings:
        row: dict[str, Any] = {"setting": setting.name}
        if setting in failures:
            rows.append({**row, "error": failures[setting]})
            continue
        result = scored[setting]
        row["perplexity"] = perplexity(result.logprobs)
        row["wall_s"] = result.wall_s
        if reference is not None:
            row["perplexity_vs_float32"] = row["perplexity"] / perplexity(reference.logprobs) - 1
            row.update(asdict(agreement(reference.tops, result.tops)))
        target = target_for(setting)
        if target is not None:
            base, allowed = target
            row["target"] = {"against": base.name, "max_rise": allowed}
            if base in scored:
                rise = row["perplexity"] / perplexity(scored[base].logprobs) - 1
                row["target"].update(rise=rise, met=rise <= allowed)
        rows.append(row)
    return {
        "text": {
            "num_tokens": num_tokens,
            "num_windows": len(windows),
            "num_scored_tokens": sum(w.num_scored for w in windows),
            "window": args.window,
            "stride": args.stride,
        },
        "top_n": args.top_n,
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "settings": rows,
    }


def print_report(report: dict[str, Any]) -> None:
    print(f"\n{'setting':<22}{'perplexity':>11}{'vs fp32':>9}{'top-1 agr.':>11}{'mean KL':>10}{'coverage':>9}  target")
    for row in report["settings"]:
        if "error" in row:
            print(f"{row['setting']:<22}  {row['error']}")
            continue
        line = f"{row['setting']:<22}{row['perplexity']:>11.4f}"
        if "perplexity_vs_float32" in row:
            line += (
                f"{row['perplexity_vs_float32']:>+9.2%}{row['top1_agreement']:>11.2%}"
                f"{row['mean_kl']:>10.5f}{row['mean_coverage']:>9.1%}"
            )
        target = row.get("target")
        if target is not None:
            line += f"  ≤ {target['max_rise']:+.1%} vs {target['against']}: "
            line += (
                f"{target['rise']:+.2%} {'met' if target['met'] else 'MISSED'}" if "rise" in target
                else f"needs {target['against']} in the run"
            )
        print(line)


def _tokenizer(model: str | None) -> Any:
    from transformers import AutoTokenizer

    if model is None:
        from pdserve.engine.default_model import ensure_default_tokenizer

        return AutoTokenizer.from_pretrained(str(ensure_default_tokenizer()))
    return AutoTokenizer.from_pretrained(model)


if __name__ == "__main__":
    main()
