"""W1 with a different JSON schema on every request, against W1 unconstrained, side by side in one process.

    python -m benchmarks.structured_w1 [--repeats 3] [--dtype auto]

W1 (32 seeded random prompts of 32-256 tokens, 64 greedy output tokens each, EOS ignored), on the default model:

- ``free``: W1 as it is;
- ``schemas, cold``: each request held to a JSON schema of its own (an object whose one field is a list of 40
  integers below 1,000, under a name no other request or round uses, so each is compiled on arrival: it cannot
  complete within 64 tokens, so every request still writes 64);
- ``schemas, cached``: the same schemas again (compiled matchers copied from the engine's cache).

Rounds alternate the three, best of ``--repeats``; output tokens/s and the ratio to ``free``. Then the delay a cold
compile adds to the first token: one request (W1's first prompt, one output token) free, under a cold 20-field
schema (``benchmarks.grammar_backends.twenty_field_schema``, new each time) and under a cached one.

Target (the issue of structured output): ``schemas, cold`` at least 0.9x ``free``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.grammar_backends import twenty_field_schema
from benchmarks.workload import make_workload

VOCAB_SIZE = 49152


def request_schema(round_index: int, request: int) -> dict[str, Any]:
    """A schema no other (round, request) uses: a list of 40 integers below 1,000 under a name of its own."""
    name = f"values_{round_index}_{request}"
    return {"type": "object", "additionalProperties": False, "required": [name],
            "properties": {name: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                                  "minItems": 40, "maxItems": 40}}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    from pdserve.engine import LLM, SamplingParams, StructuredOutputsParams

    w1 = make_workload(32, 32, 256, 64, VOCAB_SIZE, 0)
    prompts = w1.prompt_lists()
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)

    def params(schema: dict[str, Any] | None, max_tokens: int = w1.output_len) -> SamplingParams:
        spec = StructuredOutputsParams(json=schema) if schema is not None else None
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=spec)

    def timed(run: Any) -> tuple[float, int]:
        start = time.perf_counter()
        outputs = run()
        return time.perf_counter() - start, sum(len(out.token_ids) for out in outputs)

    llm.generate(prompts[:2], params(None, 4))  # warm-up
    best = {"free": 0.0, "schemas, cold": 0.0, "schemas, cached": 0.0}
    for round_index in range(args.repeats):
        schemas = [request_schema(round_index, i) for i in range(len(prompts))]
        runs = {
            "free": lambda: llm.generate(prompts, params(None)),
            "schemas, cold": lambda: llm.generate(prompts, [params(s) for s in schemas]),
            "schemas, cached": lambda: llm.generate(prompts, [params(s) for s in schemas]),
        }
        for name, run in runs.items():
            seconds, tokens = timed(run)
            assert tokens == len(prompts) * w1.output_len, (name, tokens)
            best[name] = max(best[name], tokens / seconds)
    print(f"W1: {len(prompts)} prompts, {w1.output_len} output tokens each; dtype {llm.engine.dtype}; "
          f"best of {args.repeats}")
    print("| run | output tok/s | x free |")
    for name, rate in best.items():
        print(f"| {name} | {rate:.1f} | {rate / best['free']:.3f} |")

    first = [prompts[0]]
    delays = {"free": float("inf"), "cold 20-field schema": float("inf"), "cached 20-field schema": float("inf")}
    for repeat in range(args.repeats):
        schema = twenty_field_schema(f"first token {repeat}")[0]
        for name, schema_or_none in (("free", None), ("cold 20-field schema", schema),
                                     ("cached 20-field schema", schema)):
            seconds, _ = timed(lambda: llm.generate(first, params(schema_or_none, 1)))
            delays[name] = min(delays[name], seconds)
    print("| first token of one request | ms | over free, ms |")
    for name, seconds in delays.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {(seconds - delays['free']) * 1e3:+.1f} |")


if __name__ == "__main__":
    main()
