"""The attention-backend interface and the batch description every backend starts from."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.kv.cache import QuantizedKV, dequantize_int8, quantize_int8

# One layer's keys or values in the pool: a tensor in the KV dtype, or int8 data with scales.
CacheTensor = torch.Tensor | QuantizedKV


@dataclass(frozen=True)
class AttentionBatch:
    """The sequences of one step, as attention needs them; built once per step by the runner.

    Decode sequences (one new token each) come first in the flattened token
    batch, then prefill chunks. ``context_lens[i]`` is sequence i's length after
    this step (cached prefix + new tokens).
    """

    num_decodes: int
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    # Cache slot (block_id * block_size + offset) of every new token: (num_tokens,)
    slot_mapping: torch.Tensor
    block_size: int
    device: torch.device
    # The model's attention shape: query heads, and the KV heads they share
    num_heads: int
    num_kv_heads: int
    # A paged pool (engine.kv.pages): the batch of each layer group, its block tables and slots in that
    # group's pages; ``layer_groups`` gives each layer's group. None: every layer reads the tables above.
    groups: tuple[AttentionBatch, ...] | None = None
    layer_groups: tuple[int, ...] = ()


class LayerMetadata(tuple):
    """Per-layer attention metadata, where layer groups read different pages (a paged pool)."""


class AttentionBackend(abc.ABC):
    """Writes a layer's new K/V into the paged cache and attends over each sequence's context."""

    name: str

    @abc.abstractmethod
    def build_metadata(self, batch: AttentionBatch) -> Any:
        """Per-step tensors shared by every layer (masks, gather indices, cu_seqlens)."""

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        key_cache: CacheTensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        value_cache: CacheTensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        metadata: Any,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        """Store ``key``/``value`` at the batch's slots, then return causal attention output.

        ``window``: a sliding-window layer's window (a token attends to itself and the ``window - 1``
        before it, as transformers masks it); None: the whole context. ``scale``: the scores' factor
        (None: ``head_dim ** -0.5``). ``softcap``: scores become ``softcap * tanh(score / softcap)``
        before the softmax (Gemma 2); None: uncapped."""

    def forward_latent(
        self,
        q_nope: torch.Tensor,  # (num_tokens, num_heads, nope_dim)
        q_rope: torch.Tensor,  # (num_tokens, num_heads, rope_dim), rotated
        latent: torch.Tensor,  # (num_tokens, 1, latent_dim + rope_dim): each new token's cached row
        cache: CacheTensor,  # (num_blocks, block_size, 1, latent_dim + rope_dim)
        metadata: Any,
        layer: Any,  # models.deepseek.LatentAttention: absorb, unabsorb, expand, scale
    ) -> torch.Tensor:  # (num_tokens, num_heads, v_head_dim)
        """Multi-head latent attention (DeepSeek's MLA): store ``latent`` at the batch's slots, then attend, in
        the absorbed form for decodes and the expanded one for prefill chunks (models/deepseek.py)."""
        raise ValueError(f"the {self.name} attention backend does not serve latent attention (MLA); "
                         "use attention_backend 'cpu_paged' or 'sdpa'")


def write_to_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,
    key_cache: CacheTensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    value_cache: CacheTensor,
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> tuple[CacheTensor, CacheTensor]:
    """Store each new token's K/V at its slot (cast or quantized to the cache's dtype);
    returns the caches viewed as (slots, kv_heads, head_dim)."""
    return store_rows(key, key_cache, slot_mapping), store_rows(value, value_cache, slot_mapping)


def flat_slots(cache: CacheTensor) -> CacheTensor:
    """The cache viewed as (num_blocks * block_size, num_kv_heads, head_dim): one row per slot."""
    if isinstance(cache, QuantizedKV):
        num_blocks, block_size, num_kv_heads, head_dim = cache.data.shape
        return QuantizedKV(
            cache.data.view(num_blocks * block_size, num_kv_heads, head_dim),
            cache.scales.view(num_blocks * block_size, num_kv_heads),
        )
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return cache.view(num_blocks * block_size, num_kv_heads, head_dim)


def store_rows(new: torch.Tensor, cache: CacheTensor, slot_mapping: torch.Tensor) -> CacheTensor:
    """Store each new token's rows (num_tokens, num_kv_heads, head_dim) at its slot, cast or quantized to the
    cache's dtype; returns the cache viewed as (slots, kv_heads, head_dim)."""
    flat = flat_slots(cache)
    if isinstance(flat, QuantizedKV):
        data, scales = quantize_int8(new)
        flat.data.index_copy_(0, slot_mapping, data)
        flat.scales.index_copy_(0, slot_mapping, scales)
        return flat
    flat.index_copy_(0, slot_mapping, new.to(flat.dtype))
    return flat


def read_cache(cache: CacheTensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``index`` of the cache's first dimension (blocks, or slots of a flat view), in ``dtype``."""
    if isinstance(cache, QuantizedKV):
        return dequantize_int8(cache.data.index_select(0, index), cache.scales.index_select(0, index), dtype)
    return cache.index_select(0, index).to(dtype)
