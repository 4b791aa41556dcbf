"""Tensor parallelism on this machine: step times at TP 1 and 2 (vocabulary-split against replicated LM head),
what the collectives cost, the split head against rank 0 alone by row count, bytes per handoff.

    OMP_NUM_THREADS=1 python -m benchmarks.tensor_parallel [--layers 30] [--repeats 5] [--json out.json]

1. Step times: a random-weight model of SmolLM2-135M's size but 8 query / 4 KV heads
   (576 hidden, 1536 intermediate, ``--layers`` layers, 49152 vocab, tied; SmolLM2's own
   9 heads do not split over 2 ranks) in float32, one engine per TP size, side by
   side in one run: a 256-token prefill step, and decode steps at batch 1, 8 and 32
   (contexts of ~64 tokens). TP 2 on one engine in two modes, alternating step by
   step: the LM head split by vocabulary (forced for every step) and rank 0
   computing the logits alone (the replicated head's path; the engine's default
   above ``SPLIT_LM_HEAD_MAX_ROWS`` sampled rows).
   Min and median over ``--repeats`` rounds.
2. The collectives alone, between two gloo ranks on loopback: one all-reduce of
   (rows, hidden) float32 (a step does 2 per layer) and the step-input broadcast.
3. The LM head alone, by row count, between the same two ranks with the engine's
   code (pdserve/engine/parallel/vocab_head.py): split (each rank its half, rank 0 receives
   the other half's logits) against rank 0 alone over the whole vocabulary. Where
   the split stops paying is ``SPLIT_LM_HEAD_MAX_ROWS``.
4. Bytes per handoff for each prefill-TP -> decode-TP pair (from the sharding code,
   pdserve/engine/parallel/sharding.py + kv_shards.py): what each decode rank receives
   (exactly its heads), and what the prefill ranks send their rank 0 first.

On 2 cores, TP 2 cannot be faster than TP 1 on both cores: both ranks share the
cores the one rank had, and every step adds 2 x layers all-reduces. The figures
say what that costs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS = 576, 1536, 49152, 8, 4
DECODE_BATCHES = (1, 8, 32)
ALWAYS_SPLIT = 1 << 30  # a split head row limit no step reaches


def _build_checkpoint(directory: Path, layers: int) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(directory)
    return directory


def _step_times(path: Path, repeats: int) -> dict[str, dict[str, float]]:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.parallel import vocab_head
    from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from pdserve.engine.types.sampling_params import SamplingParams

    engines = {
        tp: LLMEngine(EngineConfig(
            model=ModelConfig(model=str(path), dtype="float32", device="cpu"),
            cache=CacheConfig(num_kv_blocks=256, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=256),
            parallel=ParallelConfig(tensor_parallel_size=tp),
        ))
        for tp in (1, 2)
    }
    split_rows = vocab_head.SPLIT_LM_HEAD_MAX_ROWS
    # Per engine, the LM head modes measured step by step in turn, as the split head's row limit:
    # every step split, whatever the default limit, or none (rank 0 alone, as the replicated head).
    modes = {1: [("tp1", split_rows)], 2: [("tp2 split head", ALWAYS_SPLIT), ("tp2 replicated head", 0)]}
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    samples: dict[str, list[float]] = {}
    try:
        for _ in range(repeats):
            for tp, engine in engines.items():
                for label, max_rows in modes[tp]:
                    vocab_head.SPLIT_LM_HEAD_MAX_ROWS = max_rows
                    # prefill: one 256-token step
                    request = engine.add_request(list(range(3, 259)), SamplingParams(max_tokens=1, temperature=0.0))
                    start = time.perf_counter()
                    engine.step()
                    samples.setdefault(f"{label} prefill 256", []).append(time.perf_counter() - start)
                    engine.abort_request(request)
                for batch in DECODE_BATCHES:
                    ids = [engine.add_request(list(range(10 + i, 70 + i)), params) for i in range(batch)]
                    while engine.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in _seqs(engine, ids)):
                        engine.step()
                    times: dict[str, list[float]] = {}
                    for _ in range(5):
                        for label, max_rows in modes[tp]:  # in turn, step by step: the same load for each
                            vocab_head.SPLIT_LM_HEAD_MAX_ROWS = max_rows
                            start = time.perf_counter()
                            engine.step()
                            times.setdefault(label, []).append(time.perf_counter() - start)
                    for label, values in times.items():
                        samples.setdefault(f"{label} decode b{batch}", []).append(statistics.median(values))
                    for request_id in ids:
                        engine.abort_request(request_id)
    finally:
        vocab_head.SPLIT_LM_HEAD_MAX_ROWS = split_rows
        for engine in engines.values():
            engine.shutdown()
    return {name: {"min_ms": 1e3 * min(v), "median_ms": 1e3 * statistics.median(v)} for name, v in samples.items()}


def _seqs(engine, ids):  # noqa: ANN001, ANN202
    return [engine._requests[i] for i in ids]


def _collective_rank(rank: int, port: int, rows_list: list[int], head_rows: list[int], iterations: int,
                     head_iterations: int, out: dict) -> None:  # noqa: ANN001
    from types import SimpleNamespace

    from pdserve.engine.layers.linear import PackedLinear
    from pdserve.engine.parallel.group import TensorParallelGroup
    from pdserve.engine.parallel.vocab_head import (
        VocabSplitHead,
        gather_split_logits,
        linear_over,
        send_split_logits,
        vocab_range,
    )

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=60)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = dist.ProcessGroupGloo(store, rank, 2, options)
    results = {}
    for rows in rows_list:
        tensor = torch.randn((rows, HIDDEN))
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            group.allreduce([tensor]).wait()
            times.append(time.perf_counter() - start)
        results[f"all_reduce rows={rows}"] = 1e3 * statistics.median(times)
        header = torch.zeros(8, dtype=torch.long)
        payload = torch.zeros(3 * rows + 64, dtype=torch.long)
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            group.broadcast([header], dist.BroadcastOptions()).wait()
            group.broadcast([payload], dist.BroadcastOptions()).wait()
            times.append(time.perf_counter() - start)
        results[f"step broadcast rows={rows}"] = 1e3 * statistics.median(times)
    # The LM head: the engine's split (each rank its half, rank 0 receives the other's logits)
    # against rank 0 alone over the whole vocabulary (what the replicated head does).
    tp_group = TensorParallelGroup(dist.PrefixStore("head/", store), rank, 2, "gloo", 60.0, torch.device("cpu"))
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN) * 0.02  # (vocab, hidden), the same on both ranks
    own = vocab_range(VOCAB, 2, rank)
    own_head = PackedLinear([linear_over(weight[own.start : own.stop])])
    head = VocabSplitHead(own_head, PackedLinear([linear_over(weight[own.stop :])])) if rank == 0 else None
    follower = SimpleNamespace(compute_logits=own_head)
    for rows in head_rows:
        x = torch.randn(rows, HIDDEN)
        split, alone = [], []
        for _ in range(head_iterations + 1):  # the first round warms up (not counted)
            tp_group.broadcast(torch.zeros(1, dtype=torch.long))  # both ranks start together
            start = time.perf_counter()
            if rank == 0:
                gather_split_logits(head, x, tp_group, torch.device("cpu"))
            else:
                send_split_logits(follower, x, tp_group, torch.device("cpu"))
            split.append(time.perf_counter() - start)
            tp_group.broadcast(torch.zeros(1, dtype=torch.long))
            if rank == 0:
                start = time.perf_counter()
                head(x)
                alone.append(time.perf_counter() - start)
        if rank == 0:
            results[f"lm_head split rows={rows}"] = 1e3 * statistics.median(split[1:])
            results[f"lm_head rank 0 alone rows={rows}"] = 1e3 * statistics.median(alone[1:])
    if rank == 0:
        out.update(results)


def _collectives(rows_list: list[int], head_rows: list[int], iterations: int, head_iterations: int) -> dict[str, float]:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    manager = mp.get_context("spawn").Manager()
    out = manager.dict()
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=_collective_rank, args=(r, port, rows_list, head_rows, iterations, head_iterations, out))
        for r in (0, 1)
    ]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=1800)
    result = dict(out)
    manager.shutdown()
    return result


def handoff_bytes(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int, num_tokens: int,
                  block_size: int, pairs: list[tuple[int, int]]) -> list[dict[str, object]]:
    """Per P->D pair: bytes each decode rank receives and bytes the prefill ranks send their rank 0."""
    from pdserve.engine.parallel.kv_shards import head_sources
    from pdserve.engine.parallel.sharding import kv_heads_of_rank

    num_blocks = -(-num_tokens // block_size)
    per_head = num_layers * 2 * num_blocks * block_size * head_dim * element_size
    rows = []
    for prefill_tp, decode_tp in pairs:
        received = [len(kv_heads_of_rank(num_kv_heads, decode_tp, d)) * per_head for d in range(decode_tp)]
        gathered = 0
        for d in range(decode_tp):
            wanted = kv_heads_of_rank(num_kv_heads, decode_tp, d)
            gathered += sum(len(part) * per_head for rank, part in head_sources(num_kv_heads, prefill_tp, wanted) if rank)
        rows.append({"pair": f"P={prefill_tp} -> D={decode_tp}", "per_decode_rank": received,
                     "total_on_the_wire": sum(received), "prefill_internal_gather": gathered})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--head-iterations", type=int, default=10, help="rounds of each LM head measurement")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict[str, object] = {"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}
    with tempfile.TemporaryDirectory() as tmp:
        path = _build_checkpoint(Path(tmp), args.layers)
        report["steps"] = _step_times(path, args.repeats)
    report["collectives_ms"] = _collectives([1, 8, 256], [1, 8, 32, 64, 128, 256], args.iterations,
                                            args.head_iterations)
    # 30 layers, head_dim 64, float32, a 512-token prompt in 16-token blocks; 6 KV heads, then 2
    # (where decode ranks outnumber KV heads, each replica receives its head).
    report["handoff_bytes"] = handoff_bytes(30, 6, 64, 4, 512, 16, [(1, 1), (2, 1), (1, 2), (2, 3), (3, 2), (1, 3)])
    report["handoff_bytes_2kv"] = handoff_bytes(30, 2, 64, 4, 512, 16, [(1, 4), (4, 1), (2, 4)])
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
