"""The ``pdserve`` console script."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three primary colours.",
)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: from free memory)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")


def _run_offline(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    print(f"loaded {llm.engine.model_id} in {time.perf_counter() - start:.1f} s "
          f"({llm.engine.dtype}, {llm.engine.device}, {llm.engine.block_manager.num_blocks} KV blocks)")
    questions = args.prompt or list(DEMO_QUESTIONS)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    conversations = [[{"role": "user", "content": q}] for q in questions]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    for question, out in zip(questions, outputs):
        print(f"\n>>> {question}\n{out.text.strip()}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} completions, {total} output tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with disaggregated prefill and decode")
    commands = parser.add_subparsers(dest="command", required=True)
    offline = commands.add_parser("offline", help="generate chat completions in this process and print them")
    _add_engine_args(offline)
    offline.add_argument("prompt", nargs="*", help="user messages (default: a few demo questions)")
    offline.add_argument("--max-tokens", type=int, default=64)
    offline.add_argument("--temperature", type=float, default=0.0)
    offline.add_argument("--seed", type=int, default=None)
    offline.set_defaults(func=_run_offline)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"pdserve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
