"""Calls the paged-attention C kernel (``pdserve/engine/kernels/paged_attention.c``) on CPUs.

The kernel attends short queries (decode tokens, and the few tokens a
speculative step verifies) over the paged cache where it lies. It is built into
the package as a torch operator (``pdserve.engine.native``); a package built
without its kernels makes ``load_paged_attention_kernel`` return None, and the
engine keeps the pure-torch SDPA path.

A step's work is split over threads by OpenMP inside the kernel, on the
OpenMP runtime torch itself runs on, so that the kernel's threads are the ones
torch's GEMMs use: the plan cuts the work items into ranges of about equal
cost, one per thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.engine.kv.cache import QuantizedKV
from pdserve.engine.native import KernelOps, load_kernel_ops

# The C side's kv_kind codes.
_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
# The KV dtypes the kernel reads; queries may be float32 or bfloat16 (computed in float32).
KERNEL_KV_DTYPES = tuple(_KV_KINDS)
KERNEL_QUERY_DTYPES = (torch.float32, torch.bfloat16)
# Query vectors the C side scores per pass over a KV head's rows (VECTORS_PER_PASS there).
_VECTORS_PER_PASS = 4
# Work under this many (context position x pass) units runs on the calling thread:
# handing it to another thread costs more than it saves (batch-1 decode).
_MIN_PARALLEL_WORK = 4096


@dataclass(frozen=True)
class KernelPlan:
    """One step's sequences for the kernel, built once and shared by every layer.

    Sequence i owns query rows ``query_rows[i]`` .. ``+ query_lens[i] - 1`` of
    the flattened batch; its queries sit at the end of ``context_lens[i]``
    positions. ``item_ranges`` split the work items (sequence x KV head) over
    threads; ``range_points`` holds the same ranges as their boundaries, for the C side.
    """

    block_tables: torch.Tensor  # (num_seqs, max_blocks) int64, padded with 0
    context_lens: torch.Tensor  # (num_seqs,) int64
    query_rows: torch.Tensor  # (num_seqs,) int64
    query_lens: torch.Tensor  # (num_seqs,) int64
    item_ranges: tuple[tuple[int, int], ...]
    range_points: torch.Tensor  # (len(item_ranges) + 1,) int64


class PagedAttentionKernel:
    """Attention of short queries over the paged cache, on CPU, float32 arithmetic.

    The cache may be float32, bfloat16 or int8 (a ``QuantizedKV`` with its
    scales); queries and output are float32 or bfloat16. The work items of a
    step run on up to ``num_threads`` OpenMP threads side by side, split into
    contiguous ranges of about equal cost.
    """

    def __init__(self, kernels: KernelOps, num_threads: int) -> None:
        self._ops, self._variant = kernels.ops, kernels.variant
        self.variant = kernels.name
        self.num_threads = max(1, num_threads)

    def plan(
        self,
        query_rows: list[int],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        num_kv_heads: int,
        group: int,
    ) -> KernelPlan:
        for q_len, ctx_len in zip(query_lens, context_lens):
            if not 1 <= q_len <= ctx_len:
                raise ValueError(f"each query length must be in [1, its context length], got {q_len} over {ctx_len}")
        max_blocks = max(len(table) for table in block_tables)
        tables = [table + [0] * (max_blocks - len(table)) for table in block_tables]
        costs = []
        for q_len, ctx_len in zip(query_lens, context_lens):
            costs += [ctx_len * math.ceil(q_len * group / _VECTORS_PER_PASS)] * num_kv_heads
        ranges = self.split(costs)
        return KernelPlan(
            block_tables=torch.tensor(tables, dtype=torch.long),
            context_lens=torch.tensor(context_lens, dtype=torch.long),
            query_rows=torch.tensor(query_rows, dtype=torch.long),
            query_lens=torch.tensor(query_lens, dtype=torch.long),
            item_ranges=ranges,
            range_points=torch.tensor([begin for begin, _ in ranges] + [ranges[-1][1]], dtype=torch.long),
        )

    def split(self, costs: list[int]) -> tuple[tuple[int, int], ...]:
        """Up to ``num_threads`` contiguous ranges of items of about equal total cost (one when the work is small)."""
        total = sum(costs)
        threads = self.num_threads if total >= _MIN_PARALLEL_WORK else 1
        points = [0]
        running = 0
        for index, cost in enumerate(costs):
            running += cost
            if len(points) < threads and running * threads >= total * len(points) and index + 1 < len(costs):
                points.append(index + 1)
        points.append(len(costs))
        return tuple(zip(points[:-1], points[1:]))

    def __call__(
        self,
        query: torch.Tensor,  # (num_rows, num_heads, head_dim); rows may be strided, each row's heads contiguous
        key_cache: torch.Tensor | QuantizedKV,  # (num_blocks, block_size, num_kv_heads, head_dim)
        value_cache: torch.Tensor | QuantizedKV,
        plan: KernelPlan,
        scale: float,
        out: torch.Tensor,  # like query; the plan's rows are written, the others left as they are
        window: int | None = None,  # a token sees itself and the window - 1 before it; None: every position
        softcap: float | None = None,  # scores become softcap * tanh(score / softcap); None: uncapped
    ) -> None:
        key_data = key_cache.data if isinstance(key_cache, QuantizedKV) else key_cache
        value_data = value_cache.data if isinstance(value_cache, QuantizedKV) else value_cache
        _, block_size, num_kv_heads, head_dim = key_data.shape
        kv_dtype = key_data.dtype
        if kv_dtype not in _KV_KINDS:
            raise ValueError(f"the paged attention kernel reads KV in {KERNEL_KV_DTYPES}, got {kv_dtype}")
        quantized = isinstance(key_cache, QuantizedKV)
        if quantized != (kv_dtype == torch.int8) or isinstance(value_cache, QuantizedKV) != quantized:
            raise ValueError("int8 key_cache and value_cache must both be QuantizedKV (data with scales)")
        if query.dtype not in KERNEL_QUERY_DTYPES or out.dtype != query.dtype or out.shape != query.shape:
            raise ValueError(f"query and out must be float32 or bfloat16 of one shape, got {query.dtype}, {out.dtype}")
        if query.stride(2) != 1 or query.stride(1) != head_dim or query.device.type != "cpu":
            raise ValueError(f"query must be a CPU tensor with each row's heads contiguous, strides {query.stride()}")
        checks = [("out", out, query.dtype), ("key_cache", key_data, kv_dtype), ("value_cache", value_data, kv_dtype)]
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if isinstance(key_cache, QuantizedKV) and isinstance(value_cache, QuantizedKV):
            checks += [("key_scales", key_cache.scales, torch.float32), ("value_scales", value_cache.scales, torch.float32)]
            scales = (key_cache.scales, value_cache.scales)
        # The C side trusts these layouts; anything else would read the wrong memory.
        for name, tensor, dtype in checks:
            if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor")
        # One call: the ranges run on OpenMP threads (or in turn, on one thread).
        status = self._ops.paged_attention(
            self._variant, out, query, query.stride(0), int(query.dtype == torch.bfloat16), key_data, value_data,
            _KV_KINDS[kv_dtype], *scales, plan.block_tables, plan.context_lens, plan.query_rows, plan.query_lens,
            plan.range_points, len(plan.item_ranges), plan.block_tables.shape[1], num_kv_heads,
            query.shape[1] // num_kv_heads, head_dim, block_size, scale, window or 0, softcap or 0.0,
        )
        if status == -1:
            raise MemoryError("the paged attention kernel could not allocate its score buffer")
        if status != 0:
            raise ValueError("the paged attention kernel was given a query longer than its context")

    def store(
        self,
        key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim); rows may be strided (a view of fused q/k/v)
        value: torch.Tensor,  # like key
        key_cache: torch.Tensor | QuantizedKV,  # (num_blocks, block_size, num_kv_heads, head_dim)
        value_cache: torch.Tensor | QuantizedKV,
        slot_mapping: torch.Tensor,  # (num_tokens,) int64: block_id * block_size + offset
    ) -> None:
        """Writes each token's K/V at its slot, cast or int8-quantized exactly as ``attention.backend.store_rows`` does."""
        key_data = key_cache.data if isinstance(key_cache, QuantizedKV) else key_cache
        value_data = value_cache.data if isinstance(value_cache, QuantizedKV) else value_cache
        kv_dtype = key_data.dtype
        if kv_dtype not in _KV_KINDS or value_data.dtype != kv_dtype:
            raise ValueError(
                f"key_cache and value_cache must be one of {KERNEL_KV_DTYPES}, got {kv_dtype}, {value_data.dtype}"
            )
        if (kv_dtype == torch.int8) != isinstance(key_cache, QuantizedKV) or type(key_cache) is not type(value_cache):
            raise ValueError("int8 key_cache and value_cache must both be QuantizedKV (data with scales)")
        num_tokens, num_kv_heads, head_dim = key.shape
        if key_data.shape[2:] != (num_kv_heads, head_dim) or value.shape != key.shape:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must fit the cache's "
                             f"{tuple(key_data.shape[2:])} heads")
        for name, tensor in (("key", key), ("value", value)):
            if tensor.dtype not in KERNEL_QUERY_DTYPES or tensor.dtype != key.dtype or tensor.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU float32 or bfloat16 tensor like key, got {tensor.dtype}")
            if tensor.stride(2) != 1 or tensor.stride(1) != head_dim:
                raise ValueError(f"{name}'s heads must be contiguous within a token's row, strides {tensor.stride()}")
        checks = [("key_cache", key_data, kv_dtype), ("value_cache", value_data, kv_dtype),
                  ("slot_mapping", slot_mapping, torch.long)]
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if isinstance(key_cache, QuantizedKV) and isinstance(value_cache, QuantizedKV):
            checks += [("key_scales", key_cache.scales, torch.float32),
                       ("value_scales", value_cache.scales, torch.float32)]
            scales = (key_cache.scales, value_cache.scales)
        for name, tensor, dtype in checks:
            if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor")
        if slot_mapping.shape != (num_tokens,):
            raise ValueError(
                f"slot_mapping must hold one slot per token ({num_tokens}), got {tuple(slot_mapping.shape)}"
            )
        if num_tokens == 0:
            return
        num_slots = key_data.shape[0] * key_data.shape[1]
        status = self._ops.store_kv(
            self._variant, key, value, int(key.dtype == torch.bfloat16), key.stride(0), value.stride(0),
            key_data, value_data, _KV_KINDS[kv_dtype], *scales, slot_mapping, num_tokens, num_slots, num_kv_heads,
            head_dim,
        )
        if status == -3:
            raise ValueError(f"slot_mapping must lie in [0, {num_slots}) (the pool's slots); nothing was written")
        if status != 0:
            raise ValueError(f"the KV write cannot serve head_dim {head_dim} or KV dtype {kv_dtype}")


def load_paged_attention_kernel(num_threads: int | None = None, variant: str | None = None) -> PagedAttentionKernel | None:
    """The kernel at ``variant`` (None: the best this CPU runs; ``pdserve.engine.native.load_kernel_ops``), over
    ``num_threads`` threads (None: torch's); None where this package was built without its kernels."""
    kernels = load_kernel_ops(variant)
    if kernels is None:
        return None
    return PagedAttentionKernel(kernels, num_threads if num_threads is not None else torch.get_num_threads())
