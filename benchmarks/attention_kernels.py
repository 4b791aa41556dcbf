"""Two builds of the paged decode-attention kernel side by side: this tree's and another commit's.

    python -m benchmarks.attention_kernels --old-tree /tmp/oldtree [--threads 1] [--repeats 8]

``--old-tree`` is a checkout of an earlier commit (``git worktree add /tmp/oldtree 9f303ab``)
whose ``pdserve/engine/attention/cpu_kernel.py`` is the decode-only kernel (``load_paged_decode_kernel``).
Both kernels attend the same decode step, alternating in one process: batch 32 at the mean
context of the offline workload mid-run (190 tokens), SmolLM2-135M's shape (30 layers, 9 query
heads over 3 KV heads of 64), per KV dtype; minimum and median milliseconds of a whole step
(every layer). Queries are float32 over a float32 cache and bfloat16 over the compact ones, as
in a float32 and a bf16 model. It measures the rewrite against the kernel it replaced.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

from benchmarks.kv_cache_dtypes import BLOCK_SIZE, GROUP, HEAD_DIM, KV_DTYPES, NUM_KV_HEADS, NUM_LAYERS, _contexts
from pdserve.engine.attention.cpu_kernel import load_paged_attention_kernel
from pdserve.engine.kv.cache import KVCache


def _load_old(tree: Path):
    spec = importlib.util.spec_from_file_location("old_cpu_kernel", tree / "engine" / "attention" / "cpu_kernel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-tree", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    old_kernel = _load_old(args.old_tree).load_paged_decode_kernel(args.threads)
    new_kernel = load_paged_attention_kernel(args.threads)
    if old_kernel is None or new_kernel is None:
        raise SystemExit("a kernel is not available (a package built without its kernels?)")
    lens = _contexts(32, 40)
    tables, next_block = [], 1
    for n in lens:
        count = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    num_blocks = next_block
    torch.manual_seed(0)
    queries = {True: torch.randn(len(lens), NUM_KV_HEADS * GROUP, HEAD_DIM)}
    queries[False] = queries[True].bfloat16()
    values = torch.randn(NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    padded = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.long)
    context_lens = torch.tensor(lens, dtype=torch.long)
    split = old_kernel.split_points(lens)
    plan = new_kernel.plan(list(range(len(lens))), [1] * len(lens), lens, tables, NUM_KV_HEADS, GROUP)
    print(f"decode attention of a whole step ({NUM_LAYERS} layers), batch {len(lens)}, mean context "
          f"{statistics.mean(lens):.0f}, {args.threads} thread(s); ms of CPU time on the calling thread")
    for name, dtype in KV_DTYPES.items():
        cache = KVCache(NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))
        cache.import_blocks(range(num_blocks), values)
        layers = cache.layers()
        query = queries[dtype == torch.float32]
        out = torch.empty_like(query)
        runs = {
            "old": lambda q=query: [old_kernel(q, k, v, padded, context_lens, split, HEAD_DIM**-0.5) for k, v in layers],
            "new": lambda q=query, o=out: [new_kernel(q, k, v, plan, HEAD_DIM**-0.5, o) for k, v in layers],
        }
        times: dict[str, list[float]] = {key: [] for key in runs}
        for run in runs.values():
            run()
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        for _ in range(args.repeats):
            for key, run in runs.items():
                start = clock()
                run()
                times[key].append((clock() - start) * 1000)
        old, new = min(times["old"]), min(times["new"])
        print(f"  {name:<9} old min {old:6.1f} med {statistics.median(times['old']):6.1f} | "
              f"new min {new:6.1f} med {statistics.median(times['new']):6.1f} | old/new {old / new:.2f}x")


if __name__ == "__main__":
    main()
