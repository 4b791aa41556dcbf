"""torch SDPA over the paged cache: the CPU path, and the GPU fallback.

On CPU the short queries can go to the C kernel in ``cpu_kernel.py`` instead
(backend name ``cpu_paged``), which reads K/V where they lie in the block pool:
every decode token, and every chunk of at most ``KERNEL_MAX_QUERY_LEN`` tokens
over a cached context (the tokens a speculative step verifies). Longer chunks
and whole prompts use SDPA, whose matrix products win there. With a KV dtype
other than the model's (``kv_cache_dtype``), new K/V are cast or quantized on
write and the SDPA path casts or dequantizes what it gathers.

On CUDA the calls leave out cuDNN's attention, which PyTorch prefers for
bf16 and fp16 on Hopper: it builds an execution graph for every new shape
(hundreds of ms each), and prefill chunks come in every length
(``CUDA_SDPA_BACKENDS``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.engine.attention.backend import (
    AttentionBackend,
    AttentionBatch,
    CacheTensor,
    flat_slots,
    read_cache,
    store_rows,
    write_to_cache,
)
from pdserve.engine.attention.cpu_kernel import KernelPlan, PagedAttentionKernel


# Chunks of at most this many tokens over a cached context go to the C kernel
# (which scores up to four query vectors per pass over the rows it reads); longer
# ones to SDPA. Sized to cover a speculative step's k+1 tokens; where the two
# actually cross has not been measured.
KERNEL_MAX_QUERY_LEN = 16

# SDPA's choices on CUDA, in PyTorch's order, without CUDNN_ATTENTION. On an H200 a bf16
# run of 128 prompts of 32-256 tokens spent 6.8 s in prefill with cuDNN against 1.4 s in
# float32 (which cuDNN does not take); BENCHMARKS.md, "GPU checks".
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

_Forward = TypeVar("_Forward", bound=Callable[..., torch.Tensor])


def _without_cudnn_on_cuda(forward: _Forward) -> _Forward:
    """``forward`` with its SDPA calls limited to ``CUDA_SDPA_BACKENDS`` when the query is on CUDA."""

    @functools.wraps(forward)
    def limited(self: object, query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if not query.is_cuda:
            return forward(self, query, *args, **kwargs)
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            return forward(self, query, *args, **kwargs)

    return limited  # type: ignore[return-value]


@dataclass(frozen=True)
class _PrefillSpan:
    start: int  # first row of this sequence in the flattened batch
    end: int
    # None when the chunk is the whole context (attend to the fresh K/V, causal);
    # else the cache slots of every context position and the chunk's mask.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # (query_len, context_len) bool, True = attend
    context_len: int = 0
    # The chunk's masks with a sliding window, made once per window by the first layer that needs one.
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int, device: torch.device) -> torch.Tensor | None:
        """The chunk's mask under ``window`` (None where the window changes nothing: causal suffices)."""
        q_len = self.end - self.start
        if self.context_len <= window:
            return self.mask
        if window not in self.windowed:
            pos = torch.arange(self.context_len)
            q_pos = torch.arange(self.context_len - q_len, self.context_len)
            visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
            self.windowed[window] = visible.to(device)
        return self.windowed[window]


@dataclass(frozen=True)
class SdpaMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,)
    num_decodes: int
    # Block ids of every decode sequence, padded to max_blocks: (num_decodes, max_blocks)
    decode_block_tables: torch.Tensor | None
    # SDPA decodes only: (num_decodes, 1, 1, max_blocks * block_size), True = attend
    decode_mask: torch.Tensor | None
    # SDPA decodes only: (num_decodes,) their context lengths, for windowed masks
    decode_lens: torch.Tensor | None
    # The decodes and short chunks the C kernel attends (None without the kernel or without such sequences)
    kernel_plan: KernelPlan | None
    prefills: tuple[_PrefillSpan, ...]


class SdpaBackend(AttentionBackend):
    """Decodes in one padded SDPA call per layer, or in the C kernel; each prefill chunk in its own SDPA call."""

    def __init__(self, kernel: PagedAttentionKernel | None = None) -> None:
        self.kernel = kernel
        self.name = "sdpa" if kernel is None else "cpu_paged"

    def build_metadata(self, batch: AttentionBatch) -> SdpaMetadata:
        device, bs = batch.device, batch.block_size
        nd = batch.num_decodes
        decode_tables = decode_mask = lens = None
        # The kernel's sequences: every decode, and each short chunk over a cached context.
        kernel_seqs = []
        if self.kernel is not None:
            row = 0
            for i, (q_len, ctx_len) in enumerate(zip(batch.query_lens, batch.context_lens)):
                if i < nd or (q_len <= KERNEL_MAX_QUERY_LEN and ctx_len > q_len):
                    kernel_seqs.append((i, row))
                row += q_len
        elif nd:
            max_blocks = max(len(t) for t in batch.block_tables[:nd])
            tables = [t + [0] * (max_blocks - len(t)) for t in batch.block_tables[:nd]]
            decode_tables = torch.tensor(tables, dtype=torch.long, device=device)
            lens = torch.tensor(batch.context_lens[:nd], dtype=torch.long, device=device)
            # Padding positions read block 0 (zeros or another sequence's KV): masked out.
            positions = torch.arange(max_blocks * bs, device=device)
            decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        plan = None
        if kernel_seqs:
            assert self.kernel is not None
            plan = self.kernel.plan(
                [row for _, row in kernel_seqs],
                [batch.query_lens[i] for i, _ in kernel_seqs],
                [batch.context_lens[i] for i, _ in kernel_seqs],
                [batch.block_tables[i] for i, _ in kernel_seqs],
                batch.num_kv_heads,
                batch.num_heads // batch.num_kv_heads,
            )
        in_kernel = {i for i, _ in kernel_seqs}
        prefills = []
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if i < nd or i in in_kernel:
                start += q_len
                continue
            slots = mask = None
            if ctx_len != q_len:
                table = torch.tensor(batch.block_tables[i], dtype=torch.long)
                pos = torch.arange(ctx_len)
                slots = (table[pos // bs] * bs + pos % bs).to(device)
                # Query row r sits at position ctx_len - q_len + r and sees positions <= it.
                q_pos = torch.arange(ctx_len - q_len, ctx_len)
                mask = (pos[None, :] <= q_pos[:, None]).to(device)
            prefills.append(_PrefillSpan(start, start + q_len, slots, mask, ctx_len))
            start += q_len
        num_sdpa_decodes = 0 if self.kernel is not None else nd
        return SdpaMetadata(
            batch.slot_mapping, num_sdpa_decodes, decode_tables, decode_mask, lens, plan, tuple(prefills)
        )

    @_without_cudnn_on_cuda
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: CacheTensor,
        value_cache: CacheTensor,
        metadata: SdpaMetadata,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1:]
        scale = head_dim**-0.5 if scale is None else scale
        # SDPA has no soft-cap: where a family caps its scores (Gemma 2) the products are spelled out.
        attend = F.scaled_dot_product_attention if softcap is None else functools.partial(_capped_attention, softcap)
        if self.kernel is not None:
            # One C call for the whole write (cast or int8-quantized as write_to_cache does it, bit for bit).
            self.kernel.store(_heads_packed(key), _heads_packed(value), key_cache, value_cache, metadata.slot_mapping)
            flat_k, flat_v = flat_slots(key_cache), flat_slots(value_cache)
        else:
            flat_k, flat_v = write_to_cache(key, value, key_cache, value_cache, metadata.slot_mapping)

        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous, whatever query is
        nd = metadata.num_decodes
        if metadata.kernel_plan is not None:
            assert self.kernel is not None
            # Writes the plan's rows of ``out`` in place; the rest are SDPA's below.
            self.kernel(_heads_packed(query), key_cache, value_cache, metadata.kernel_plan, scale, out, window, softcap)
        if nd:
            assert metadata.decode_block_tables is not None
            block_ids = metadata.decode_block_tables.flatten()  # (nd * max_blocks,)
            # index_select on the block dimension is several times faster on CPU
            # than advanced indexing with a 2-D table.
            # (nd * max_blocks, block_size, kv_heads, head_dim) -> (nd, kv_heads, ctx, head_dim)
            k = read_cache(key_cache, block_ids, query.dtype).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
            v = read_cache(value_cache, block_ids, query.dtype).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
            # Query heads grouped under their KV head (head h uses KV head h // group,
            # as repeat_kv does): (nd, kv_heads, group, head_dim), the group acting as
            # the query length, so no KV is repeated.
            q = query[:nd].view(nd, num_kv_heads, -1, head_dim)
            mask = metadata.decode_mask
            if window is not None:
                assert metadata.decode_lens is not None
                positions = torch.arange(mask.shape[-1], device=mask.device)
                mask = mask & (positions[None, :] >= metadata.decode_lens[:, None] - window)[:, None, None, :]
            o = attend(q, k, v, attn_mask=mask, scale=scale)
            out[:nd] = o.reshape(nd, -1, head_dim)
        for span in metadata.prefills:
            q = query[span.start : span.end].transpose(0, 1)  # (heads, q_len, head_dim)
            if span.context_slots is None:
                # The whole context is this chunk: attend to its fresh K/V, not to
                # their (possibly bfloat16 or int8) copy in the cache.
                k = key[span.start : span.end].transpose(0, 1)  # (kv_heads, q_len, head_dim)
                v = value[span.start : span.end].transpose(0, 1)
            else:
                # (kv_heads, ctx_len, head_dim)
                k = read_cache(flat_k, span.context_slots, query.dtype).transpose(0, 1)
                v = read_cache(flat_v, span.context_slots, query.dtype).transpose(0, 1)
            # SDPA takes its fused CPU kernel only for 4-D inputs: add a batch of one.
            mask = span.mask if window is None else span.window_mask(window, query.device)
            if mask is None:
                o = attend(q[None], k[None], v[None], is_causal=True, enable_gqa=True, scale=scale)
            else:
                o = attend(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True, scale=scale)
            out[span.start : span.end] = o[0].transpose(0, 1)
        return out


    @_without_cudnn_on_cuda
    def forward_latent(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        cache: CacheTensor,
        metadata: SdpaMetadata,
        layer: Any,
    ) -> torch.Tensor:
        num_tokens, heads = q_nope.shape[:2]
        latent_dim = layer.latent_dim
        flat = store_rows(latent, cache, metadata.slot_mapping)  # one row per token: key and value alike
        out = torch.empty(num_tokens, heads, layer.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
        # Absorbed form for every row outside the prefill spans (the kernel's and SDPA's decodes): multi-query
        # attention of queries (q_nope @ W_UK, q_rope) over the cached rows, which serve as values too.
        rows = _rows_outside(metadata.prefills, num_tokens, q_nope.device)
        if rows is None or len(rows):
            if rows is None:
                query = torch.cat((layer.absorb(q_nope), q_rope), dim=-1)  # (n, heads, latent + rope)
            else:
                # The absorbed rows in their places in the batch: the kernel's plan names rows of it.
                query = q_nope.new_empty(num_tokens, heads, layer.head_dim)
                query[rows] = torch.cat((layer.absorb(q_nope[rows]), q_rope[rows]), dim=-1)
            out_latent = torch.empty_like(query)
            if metadata.kernel_plan is not None:
                assert self.kernel is not None
                self.kernel(query, cache, cache, metadata.kernel_plan, layer.scale, out_latent)
            nd = metadata.num_decodes
            if nd:
                assert metadata.decode_block_tables is not None
                block_ids = metadata.decode_block_tables.flatten()
                context = read_cache(cache, block_ids, query.dtype).view(nd, 1, -1, layer.head_dim)  # (nd, 1, ctx, D)
                q = query[:nd].view(nd, 1, heads, layer.head_dim)
                mask = metadata.decode_mask
                o = F.scaled_dot_product_attention(q, context, context, attn_mask=mask, scale=layer.scale)
                out_latent[:nd] = o.view(nd, heads, layer.head_dim)
            if rows is None:
                out = layer.unabsorb(out_latent[..., :latent_dim])
            else:
                out[rows] = layer.unabsorb(out_latent.index_select(0, rows)[..., :latent_dim])
        # Expanded form for prefill chunks: the context's rows expanded into every head's keys and values.
        for span in metadata.prefills:
            if span.context_slots is None:
                context = latent[span.start : span.end, 0]  # the whole context is this chunk: its fresh rows
            else:
                context = read_cache(flat, span.context_slots, q_nope.dtype)[:, 0]  # (ctx_len, D)
            keys, values = layer.expand(context)  # (ctx_len, heads, qk_dim), (ctx_len, heads, v_head_dim)
            q = torch.cat((q_nope[span.start : span.end], q_rope[span.start : span.end]), dim=-1).transpose(0, 1)
            k, v = keys.transpose(0, 1), values.transpose(0, 1)
            if span.mask is None:
                o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=layer.scale)
            else:
                o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=span.mask, scale=layer.scale)
            out[span.start : span.end] = o[0].transpose(0, 1)
        return out


def _rows_outside(spans: tuple[_PrefillSpan, ...], num_tokens: int, device: torch.device) -> torch.Tensor | None:
    """The batch rows no prefill span holds, ascending; None when that is every row (a decode step)."""
    if not spans:
        return None
    outside = torch.ones(num_tokens, dtype=torch.bool)
    for span in spans:
        outside[span.start : span.end] = False
    return outside.nonzero().squeeze(1).to(device)


def _capped_attention(
    softcap: float,
    query: torch.Tensor,  # (batch, heads, q_len, head_dim)
    key: torch.Tensor,  # (batch, kv_heads, ctx_len, head_dim)
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,  # broadcastable to (batch, heads, q_len, ctx_len), True = attend
    is_causal: bool = False,
    enable_gqa: bool = False,
    scale: float = 1.0,
) -> torch.Tensor:
    """Attention with soft-capped scores, cap * tanh(s / cap), in transformers' eager order: scale, cap,
    mask, a float32 softmax cast back, then the values; SDPA's arguments."""
    if enable_gqa and key.shape[1] != query.shape[1]:
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        q_len, ctx_len = scores.shape[-2:]
        attn_mask = torch.ones(q_len, ctx_len, dtype=torch.bool, device=scores.device).tril(ctx_len - q_len)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


def _heads_packed(x: torch.Tensor) -> torch.Tensor:
    """``x`` (num_tokens, heads, head_dim) with each token's heads contiguous, as the C kernels read rows
    (a column slice of the fused q/k/v output already is: no copy)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
