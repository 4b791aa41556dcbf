"""The CPU kernels as the package ships them against another tree's, on W1, alternated in fresh processes.

    python -m benchmarks.installed_kernels --old-tree DIR [--settings float32,int8] [--rounds 2]

For each round and setting, one process runs W1 (the offline workload: 32
prompts of 32-256 tokens, 64 tokens each, greedy, EOS ignored) through
``LLM.generate`` on the checkout at ``--old-tree`` (a commit before or after
the kernels were built into the package; its own package layout, imported from
its own folder), then one on this tree with no compiler on ``PATH`` and an
empty ``PDSERVE_CACHE_DIR``, as a fresh install would run: nothing may be
compiled, and the default model is converted anew. ``float32`` runs in float32;
``int8`` at ``dtype="auto"`` (bf16 where the CPU runs it natively) with INT8
weights. Each process reports output tokens/s (best of two passes, after a
warm-up) and a digest of every token id: equal digests mean the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run in the child, in the tree under test: ``sys.argv[1]`` is the setting, ``sys.argv[2]`` the engine's package
# (``engine`` in a tree from before the one namespace: an installed pdserve must not shadow it).
_CHILD = r"""
import hashlib, importlib, json, sys, time
engine = importlib.import_module(sys.argv[2])
LLM, SamplingParams = engine.LLM, engine.SamplingParams
from benchmarks.workload import make_warmup_workload, make_workload

setting = sys.argv[1]
llm = LLM(dtype="float32" if setting == "float32" else "auto", quantization=None if setting == "float32" else "int8")
workload = make_workload(32, 32, 256, 64, llm.engine.vocab_size, 0)
warmup = make_warmup_workload(workload, llm.engine.vocab_size, 0)
greedy = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
llm.generate(warmup.prompt_lists(), SamplingParams(max_tokens=warmup.output_len, temperature=0.0, ignore_eos=True))
best = float("inf")
for _ in range(2):
    started = time.perf_counter()
    outputs = llm.generate(workload.prompt_lists(), greedy)
    best = min(best, time.perf_counter() - started)
tokens = json.dumps([output.token_ids for output in outputs]).encode()
print(json.dumps({"tokens_per_s": round(32 * 64 / best, 1), "tokens": hashlib.sha256(tokens).hexdigest()[:16],
                  "dtype": str(llm.engine.dtype), "engine": engine.__file__}))
"""


def run(tree: Path, setting: str, fresh: bool) -> dict:
    """One child on ``tree``; ``fresh``: no compiler on PATH and an empty cache dir."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as cache:
        if fresh:
            env.update(PATH="/nonexistent", CC="/nonexistent/cc", PDSERVE_CACHE_DIR=cache)
        package = "engine" if (tree / "engine" / "__init__.py").is_file() else "pdserve.engine"
        result = subprocess.run([sys.executable, "-c", _CHILD, setting, package], cwd=tree, env=env,
                                capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{tree} ({setting}) failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-tree", type=Path, required=True, help="a checkout of the commit to compare with")
    parser.add_argument("--settings", default="float32,int8", help="comma-separated: float32, int8")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    rows: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for setting in args.settings.split(","):
            for side, tree, fresh in (("old", args.old_tree.resolve(), False), ("new", REPO, True)):
                figures = run(tree, setting, fresh)
                rows.setdefault((setting, side), []).append(figures)
                print(f"round {round_index + 1} {setting:<8} {side}: {figures['tokens_per_s']:7.1f} output tokens/s "
                      f"({figures['dtype']}), tokens {figures['tokens']}, engine {figures['engine']}", flush=True)
    for setting in args.settings.split(","):
        old, new = rows[(setting, "old")], rows[(setting, "new")]
        same = {figures["tokens"] for figures in old + new}
        print(f"{setting}: old {[f['tokens_per_s'] for f in old]}, new {[f['tokens_per_s'] for f in new]}; "
              f"tokens {'identical' if len(same) == 1 else 'DIFFER'} in every run")


if __name__ == "__main__":
    main()
