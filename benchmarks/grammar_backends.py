"""Grammar engines for structured output, side by side: llguidance (pdserve's) and xgrammar where installed.

    python -m benchmarks.grammar_backends [--repeats 5]

On the default model's tokenizer (49,152 tokens) and a 20-field JSON schema (strings of at most 12 characters,
bounded integers, booleans, numbers; ``twenty_field_schema``), compact layout, for each engine:

- ``tokenizer s``: building the engine's view of the tokenizer (once per process);
- ``cold compile ms``: the schema's first compile (each repeat makes the schema new with its own ``title``);
- ``cached ms``: the same schema again through pdserve's ``GrammarCompiler`` cache (llguidance: a copy of the
  compiled matcher) or xgrammar's own compiler cache;
- ``mask us/token``: filling the next-token mask and advancing over the tokens of a valid document.

Best of ``--repeats``. xgrammar is not a pdserve dependency (it needs torch and, on Linux x86-64, triton):
``pip install xgrammar`` into the venv to include it; docs/structured-output.md says why pdserve keeps llguidance.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def twenty_field_schema(title: str = "record") -> tuple[dict[str, Any], dict[str, Any]]:
    """A 20-field object schema (every field required, no others) and a document that matches it."""
    properties: dict[str, Any] = {}
    document: dict[str, Any] = {}
    for index in range(20):
        name = f"field_{index}"
        kind = index % 4
        if kind == 0:
            properties[name], document[name] = {"type": "string", "maxLength": 12}, "hello"
        elif kind == 1:
            properties[name], document[name] = {"type": "integer", "minimum": 0, "maximum": 1000}, 42
        elif kind == 2:
            properties[name], document[name] = {"type": "boolean"}, True
        else:
            properties[name], document[name] = {"type": "number"}, 1.5
    schema = {"title": title, "type": "object", "properties": properties, "required": list(properties),
              "additionalProperties": False}
    return schema, document


def _llguidance(tokenizer: Any, token_ids: list[int], repeats: int) -> dict[str, float]:
    import numpy as np

    from pdserve.engine.structured_output import GrammarCompiler, build_tokenizer
    from pdserve.engine.types.structured_outputs import StructuredOutputsParams

    start = time.perf_counter()
    built = build_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    result = {"tokenizer s": time.perf_counter() - start}
    compiler = GrammarCompiler(lambda: built)
    cold = cached = mask = float("inf")
    for repeat in range(repeats):
        spec = StructuredOutputsParams(json=twenty_field_schema(f"record {repeat}")[0])
        start = time.perf_counter()
        matcher = compiler.compile(spec)
        cold = min(cold, time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(spec)
        cached = min(cached, time.perf_counter() - start)
        words = np.zeros((len(tokenizer) + 31) // 32, dtype=np.int32)
        start = time.perf_counter()
        for token_id in token_ids:
            matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            assert matcher.consume_token(token_id)
        mask = min(mask, (time.perf_counter() - start) / len(token_ids))
    compiler.shutdown()
    return {**result, "cold compile ms": cold * 1e3, "cached ms": cached * 1e3, "mask us/token": mask * 1e6}


def _xgrammar(tokenizer: Any, token_ids: list[int], repeats: int) -> dict[str, float] | None:
    try:
        import xgrammar
    except ImportError:
        return None
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    result = {"tokenizer s": time.perf_counter() - start}
    compiler = xgrammar.GrammarCompiler(info)
    cold = cached = mask = float("inf")
    for repeat in range(repeats):
        schema = json.dumps(twenty_field_schema(f"record {repeat}")[0])
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        cold = min(cold, time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        cached = min(cached, time.perf_counter() - start)
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
        start = time.perf_counter()
        for token_id in token_ids:
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(token_id)
        mask = min(mask, (time.perf_counter() - start) / len(token_ids))
    return {**result, "cold compile ms": cold * 1e3, "cached ms": cached * 1e3, "mask us/token": mask * 1e6}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from pdserve.engine.default_model import ensure_default_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_tokenizer()))
    document = json.dumps(twenty_field_schema()[1], separators=(",", ":"))
    token_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    print(f"20-field schema; a valid document of {len(document)} characters, {len(token_ids)} tokens; "
          f"vocabulary {len(tokenizer)}")
    print(f"| engine | {' | '.join(('tokenizer s', 'cold compile ms', 'cached ms', 'mask us/token'))} |")
    for name, run in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
        figures = run(tokenizer, token_ids, args.repeats)
        if figures is None:
            print(f"| {name} | not installed | | | |")
            continue
        print(f"| {name} | {figures['tokenizer s']:.3f} | {figures['cold compile ms']:.2f} | "
              f"{figures['cached ms']:.3f} | {figures['mask us/token']:.1f} |")


if __name__ == "__main__":
    main()
