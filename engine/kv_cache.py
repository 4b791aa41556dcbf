"""The preallocated paged KV pool: one tensor for every layer's keys and values."""

from __future__ import annotations

import os
from typing import Sequence as Seq

import torch


class KVCache:
    """Pool of ``num_blocks`` blocks of ``block_size`` token slots, for every layer.

    Layout: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim);
    index 0 of the second dimension holds keys, 1 values. Keeping one tensor
    makes export and import of a sequence's blocks a single index operation.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # Zeroed, not empty: attention over padded positions multiplies masked
        # (zero) weights by these values, and 0 * NaN from garbage would be NaN.
        self.data = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.num_blocks = num_blocks
        self.block_size = block_size

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(key_cache, value_cache) per layer, each (num_blocks, block_size, num_kv_heads, head_dim)."""
        return [(layer[0], layer[1]) for layer in self.data]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one exported block: (num_layers, 2, block_size, num_kv_heads, head_dim)."""
        num_layers, two, _, block_size, heads, head_dim = self.data.shape
        return (num_layers, two, block_size, heads, head_dim)

    def export_blocks(self, block_ids: Seq[int]) -> torch.Tensor:
        """A copy of the given blocks: (num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim)."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.data.device)
        return self.data.index_select(2, index)

    def import_blocks(self, block_ids: Seq[int], blocks: torch.Tensor) -> None:
        """Write ``blocks`` (as returned by ``export_blocks``) into the given block ids."""
        expected = (*self.data.shape[:2], len(block_ids), *self.data.shape[3:])
        if tuple(blocks.shape) != expected:
            raise ValueError(f"imported KV blocks have shape {tuple(blocks.shape)}, expected {expected}")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, index, blocks.to(device=self.data.device, dtype=self.data.dtype))


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_memory_bytes(device: torch.device) -> int:
    """Memory the KV pool could take on ``device`` right now."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def size_kv_pool(
    block_bytes: int, memory_fraction: float, device: torch.device, max_useful_blocks: int
) -> int:
    """Number of blocks that fit in ``memory_fraction`` of available memory, capped where more is useless."""
    fit = int(available_memory_bytes(device) * memory_fraction) // block_bytes
    if fit < 1:
        raise ValueError("not enough free memory for a single KV block; lower block_size or set num_kv_blocks")
    return max(1, min(fit, max_useful_blocks))
