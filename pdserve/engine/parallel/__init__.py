"""Tensor parallelism: one engine over ``tensor_parallel_size`` ranks (processes) joined by torch.distributed.

- ``sharding``: which heads and MLP columns each rank owns, and the Megatron-style
  slicing of a loaded model (column-parallel q/k/v and gate/up, row-parallel o
  and down, one all-reduce after each; embedding lookup replicated).
- ``vocab_head``: the LM head split by vocabulary for the rows a decode step samples; rank 0
  keeps the rest for steps with many rows.
- ``group``: the rank group, every collective with a timeout.
- ``step_codec``: one step's inputs as a compact int64 tensor, broadcast by rank 0.
- ``workers``: rank 0's handle on ranks 1..N-1 (processes it starts) and their loop.
- ``kv_shards``: held KV exported from any ranks' heads; a handoff landed by every rank fetching its own.
- ``ranks``: what the runner and ``kv_shards`` need of rank 0's handle and of a follower (protocols that
  ``workers`` implements, so nothing below it imports it).

Rank 0 is the engine process: scheduler, block manager, sampler. Every rank holds
the same block ids over its own shard of the KV pool (its KV heads).
"""
