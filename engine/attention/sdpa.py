"""torch SDPA over the paged cache: the CPU path, and the GPU fallback."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionBatch


@dataclass(frozen=True)
class _PrefillSpan:
    start: int  # first row of this sequence in the flattened batch
    end: int
    # None when the chunk is the whole context (attend to the fresh K/V, causal);
    # else the cache slots of every context position and the chunk's mask.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # (query_len, context_len) bool, True = attend


@dataclass(frozen=True)
class SdpaMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,)
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # (num_decodes, max_blocks)
    decode_mask: torch.Tensor | None  # (num_decodes, 1, 1, max_blocks * block_size)
    prefills: tuple[_PrefillSpan, ...]


class SdpaBackend(AttentionBackend):
    """Decodes in one padded SDPA call per layer; each prefill chunk in its own call."""

    name = "sdpa"

    def build_metadata(self, batch: AttentionBatch) -> SdpaMetadata:
        device, bs = batch.device, batch.block_size
        nd = batch.num_decodes
        decode_tables = decode_mask = None
        if nd:
            max_blocks = max(len(t) for t in batch.block_tables[:nd])
            tables = [t + [0] * (max_blocks - len(t)) for t in batch.block_tables[:nd]]
            decode_tables = torch.tensor(tables, dtype=torch.long, device=device)
            lens = torch.tensor(batch.context_lens[:nd], dtype=torch.long, device=device)
            # Padding positions read block 0 (zeros or another sequence's KV): masked out.
            positions = torch.arange(max_blocks * bs, device=device)
            decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        prefills = []
        start = nd
        for i in range(nd, len(batch.query_lens)):
            q_len, ctx_len = batch.query_lens[i], batch.context_lens[i]
            slots = mask = None
            if ctx_len != q_len:
                table = torch.tensor(batch.block_tables[i], dtype=torch.long)
                pos = torch.arange(ctx_len)
                slots = (table[pos // bs] * bs + pos % bs).to(device)
                # Query row r sits at position ctx_len - q_len + r and sees positions <= it.
                q_pos = torch.arange(ctx_len - q_len, ctx_len)
                mask = (pos[None, :] <= q_pos[:, None]).to(device)
            prefills.append(_PrefillSpan(start, start + q_len, slots, mask))
            start += q_len
        return SdpaMetadata(batch.slot_mapping, nd, decode_tables, decode_mask, tuple(prefills))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: SdpaMetadata,
    ) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_k.index_copy_(0, metadata.slot_mapping, key)
        flat_v.index_copy_(0, metadata.slot_mapping, value)

        out = torch.empty_like(query)
        nd = metadata.num_decodes
        if nd:
            assert metadata.decode_block_tables is not None
            # (nd, max_blocks, block_size, kv_heads, head_dim) -> (nd, kv_heads, ctx, head_dim)
            k = key_cache[metadata.decode_block_tables].flatten(1, 2).transpose(1, 2)
            v = value_cache[metadata.decode_block_tables].flatten(1, 2).transpose(1, 2)
            q = query[:nd].unsqueeze(2)  # (nd, heads, 1, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.decode_mask, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for span in metadata.prefills:
            q = query[span.start : span.end].transpose(0, 1)  # (heads, q_len, head_dim)
            if span.context_slots is None:
                k = key[span.start : span.end].transpose(0, 1)  # (kv_heads, q_len, head_dim)
                v = value[span.start : span.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                k = flat_k[span.context_slots].transpose(0, 1)  # (kv_heads, ctx_len, head_dim)
                v = flat_v[span.context_slots].transpose(0, 1)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, enable_gqa=True)
            out[span.start : span.end] = o.transpose(0, 1)
        return out
