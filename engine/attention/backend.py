"""The attention-backend interface and the batch description every backend starts from."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ATTENTION_BACKENDS


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
        key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        metadata: Any,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        """Store ``key``/``value`` at the batch's slots, then return causal attention output."""


def write_to_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store each new token's K/V at its slot; returns the caches viewed as (slots, kv_heads, head_dim)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)
    return flat_k, flat_v


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """``auto``: flash-attn on CUDA in half precision when it is importable; on CPU in
    float32 the C decode kernel (``cpu_paged``) when it builds on this machine; SDPA otherwise."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    use_flash = name == "flash_attn" or (
        name == "auto" and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_attn_available()
    )
    if use_flash:
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend='flash_attn' needs a CUDA device and the flash-attn package")
        from engine.attention.flash import FlashAttentionBackend

        return FlashAttentionBackend()
    from engine.attention.sdpa import SdpaBackend

    if name == "sdpa" or (name == "auto" and (device.type != "cpu" or dtype != torch.float32)):
        return SdpaBackend()
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError("attention_backend='cpu_paged' needs device 'cpu' and dtype float32")
    from engine.attention.cpu_kernel import load_paged_decode_kernel

    kernel = load_paged_decode_kernel()
    if kernel is None and name == "cpu_paged":
        raise ValueError("attention_backend='cpu_paged' needs a C compiler to build its kernel (see the log)")
    return SdpaBackend(kernel)
