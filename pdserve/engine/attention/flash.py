"""flash-attn over the paged cache (CUDA, fp16/bf16). Imported only when selected.

Prefill chunks and decodes run in one ``flash_attn_varlen_func`` call per layer
over each sequence's context, gathered from the cache by slot; flash-attn's
causal mask is aligned to the bottom right, so a query chunk at the end of a
longer context sees exactly the positions at or before it. When the block size
is a multiple of 256 (flash-attn's paged-KV page size), decodes read the cache
in place through their block tables with ``flash_attn_with_kvcache`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.backend import AttentionBackend, AttentionBatch, write_to_cache

_PAGED_KV_PAGE_MULTIPLE = 256


@dataclass(frozen=True)
class FlashMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,)
    num_decodes: int
    paged_decode: bool
    # Paged decode: (num_decodes, max_blocks) int32 tables and (num_decodes,) int32 lengths.
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    # Varlen part (all sequences, or only the prefills when decode is paged).
    first_varlen_row: int
    context_slots: torch.Tensor | None  # (sum of context lens,)
    cu_seqlens_q: torch.Tensor | None  # (n + 1,) int32
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def build_metadata(self, batch: AttentionBatch) -> FlashMetadata:
        device, bs, nd = batch.device, batch.block_size, batch.num_decodes
        paged_decode = nd > 0 and bs % _PAGED_KV_PAGE_MULTIPLE == 0
        tables = lens = None
        first = 0
        if paged_decode:
            max_blocks = max(len(t) for t in batch.block_tables[:nd])
            padded = [t + [0] * (max_blocks - len(t)) for t in batch.block_tables[:nd]]
            tables = torch.tensor(padded, dtype=torch.int32, device=device)
            lens = torch.tensor(batch.context_lens[:nd], dtype=torch.int32, device=device)
            first = nd
        q_lens = batch.query_lens[first:]
        ctx_lens = batch.context_lens[first:]
        slots = cu_q = cu_k = None
        if q_lens:
            pieces = []
            for table, ctx_len in zip(batch.block_tables[first:], ctx_lens):
                pos = torch.arange(ctx_len)
                pieces.append(torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs)
            slots = torch.cat(pieces).to(device)
            cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
            cu_k = torch.tensor([0, *torch.tensor(ctx_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        return FlashMetadata(
            slot_mapping=batch.slot_mapping,
            num_decodes=nd,
            paged_decode=paged_decode,
            decode_block_tables=tables,
            decode_context_lens=lens,
            first_varlen_row=first,
            context_slots=slots,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(ctx_lens, default=0),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: FlashMetadata,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        flat_k, flat_v = write_to_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        # flash-attn's window counts the positions before the query it may see: ours less the query itself.
        options = {
            "softmax_scale": scale,
            "window_size": (-1, -1) if window is None else (window - 1, 0),
            "softcap": softcap or 0.0,
        }

        out = torch.empty_like(query)
        if metadata.paged_decode:
            nd = metadata.num_decodes
            o = self._with_kvcache(
                query[:nd].unsqueeze(1),  # (nd, 1, heads, head_dim)
                key_cache,
                value_cache,
                cache_seqlens=metadata.decode_context_lens,
                block_table=metadata.decode_block_tables,
                causal=True,
                **options,
            )
            out[:nd] = o.squeeze(1)
        first = metadata.first_varlen_row
        if metadata.context_slots is not None:
            out[first:] = self._varlen(
                query[first:],
                flat_k[metadata.context_slots],
                flat_v[metadata.context_slots],
                cu_seqlens_q=metadata.cu_seqlens_q,
                cu_seqlens_k=metadata.cu_seqlens_k,
                max_seqlen_q=metadata.max_seqlen_q,
                max_seqlen_k=metadata.max_seqlen_k,
                causal=True,
                **options,
            )
        return out
