"""The preallocated paged KV pool: one tensor for every layer's keys and values (and their int8 scales)."""

from __future__ import annotations

import os
from typing import NamedTuple
from typing import Sequence as Seq

import torch

from pdserve.engine.config import KV_CACHE_DTYPES

# engine.config.KV_CACHE_DTYPES other than "auto" (the model's dtype).
_KV_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "int8": torch.int8}
# int8 KV stores one float32 scale per (token, KV head); on the wire (export/import)
# its 4 bytes follow the head's head_dim int8 values, so a handoff stays one tensor.
SCALE_BYTES = 4
# Rows a pool keeps per token and layer: keys and values (2), or one latent (1: multi-head latent attention).
KV_PARTS = (1, 2)
_INT8_MAX = 127.0


class QuantizedKV(NamedTuple):
    """One layer's keys or values in int8: ``data * scales[..., None]`` is the dequantized cache."""

    data: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim) int8
    scales: torch.Tensor  # (num_blocks, block_size, num_kv_heads) float32


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last dimension: (..., head_dim) -> int8 (..., head_dim), float32 (...)."""
    x = x.float()
    scales = x.abs().amax(dim=-1) / _INT8_MAX  # (...)
    # An all-zero row keeps scale 0 and quantizes to zeros (divide by 1, not 0).
    data = (x / torch.where(scales == 0, 1.0, scales).unsqueeze(-1)).round_().clamp_(-_INT8_MAX, _INT8_MAX)
    return data.to(torch.int8), scales


def dequantize_int8(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 (..., head_dim) and float32 (...) back to ``dtype`` (..., head_dim), multiplied in float32."""
    return (data.float() * scales.unsqueeze(-1)).to(dtype)


def pack_int8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Wire format of int8 KV: (..., head_dim) int8 and (...) float32 -> (..., head_dim + 4) int8."""
    scale_bytes = scales.contiguous().unsqueeze(-1).view(torch.int8)  # (..., 4)
    return torch.cat((data, scale_bytes), dim=-1)


def unpack_int8(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_int8``: (..., head_dim + 4) int8 -> int8 (..., head_dim), float32 (...)."""
    data = packed[..., :-SCALE_BYTES]
    scales = packed[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)
    return data, scales


def wire_to_float(blocks: torch.Tensor) -> torch.Tensor:
    """Exported blocks of any KV dtype as float32 (..., head_dim): what a conversion starts from."""
    if blocks.dtype == torch.int8:
        return dequantize_int8(*unpack_int8(blocks), torch.float32)
    return blocks.float()


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` is the model's dtype (the cache before kv_cache_dtype existed, bit for bit)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _KV_DTYPES[kv_cache_dtype]


class KVCache:
    """Pool of ``num_blocks`` blocks of ``block_size`` token slots, for every layer.

    Layout: ``data`` (num_layers, parts, num_blocks, block_size, num_kv_heads, head_dim)
    in ``dtype``. With ``parts`` 2, index 0 of the second dimension holds keys, 1
    values; with ``parts`` 1 (latent attention, DeepSeek's MLA) each token has one
    row, its compressed latent and rope part, which attention reads as both. Keeping
    one tensor makes export and import of a sequence's blocks a single index
    operation. With ``dtype`` int8, ``scales`` (num_layers, parts, num_blocks,
    block_size, num_kv_heads) float32 holds each token's per-KV-head scale
    (symmetric: value = int8 * scale); otherwise ``scales`` is None.
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
        parts: int = 2,
    ) -> None:
        if not dtype.is_floating_point and dtype != torch.int8:
            raise ValueError(f"KV cache dtype must be floating point or int8, got {dtype}")
        if parts not in KV_PARTS:
            raise ValueError(f"parts must be one of {KV_PARTS}, got {parts}")
        # Zeroed, not empty: attention over padded positions multiplies masked
        # (zero) weights by these values, and 0 * NaN from garbage would be NaN.
        self.data = torch.zeros(
            (num_layers, parts, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.scales = (
            torch.zeros((num_layers, parts, num_blocks, block_size, num_kv_heads), dtype=torch.float32, device=device)
            if dtype == torch.int8
            else None
        )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype

    @property
    def is_quantized(self) -> bool:
        return self.scales is not None

    def layers(self) -> list[tuple[torch.Tensor | QuantizedKV, torch.Tensor | QuantizedKV]]:
        """(key_cache, value_cache) per layer, each (num_blocks, block_size, num_kv_heads, head_dim),
        or a ``QuantizedKV`` of that data and its (num_blocks, block_size, num_kv_heads) scales. A one-part
        pool gives its latent rows as both."""
        value = self.parts - 1
        if self.scales is None:
            return [(layer[0], layer[value]) for layer in self.data]
        return [
            (QuantizedKV(layer[0], scales[0]), QuantizedKV(layer[value], scales[value]))
            for layer, scales in zip(self.data, self.scales)
        ]

    @property
    def parts(self) -> int:
        """Rows per token and layer: 2 (keys and values) or 1 (a latent)."""
        return self.data.shape[1]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one exported block: (num_layers, parts, block_size, num_kv_heads, head_dim [+ 4 for int8])."""
        num_layers, parts, _, block_size, heads, head_dim = self.data.shape
        return (num_layers, parts, block_size, heads, head_dim + (SCALE_BYTES if self.is_quantized else 0))

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    @property
    def num_kv_heads(self) -> int:
        """KV heads this pool holds (this rank's, under tensor parallelism)."""
        return self.data.shape[4]

    def export_blocks(
        self, block_ids: Seq[int], layers: slice = slice(None), heads: range | None = None
    ) -> torch.Tensor:
        """A copy of the given blocks of ``layers``: (num_layers, parts, len(block_ids), block_size, num_kv_heads, head_dim)
        in the cache's dtype; int8 blocks carry their scales packed (``pack_int8``): head_dim + 4 int8.
        ``heads``: only these KV heads (indices into this pool's), contiguous."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.data.device)
        blocks = self.data[layers].index_select(2, index)
        scales = None if self.scales is None else self.scales[layers].index_select(2, index)
        if heads is not None and len(heads) != self.num_kv_heads:
            blocks = blocks[:, :, :, :, heads.start : heads.stop].contiguous()
            scales = None if scales is None else scales[..., heads.start : heads.stop].contiguous()
        if scales is None:
            return blocks
        return pack_int8(blocks, scales)

    def import_blocks(self, block_ids: Seq[int], blocks: torch.Tensor, layers: slice = slice(None)) -> None:
        """Write ``blocks`` (as returned by ``export_blocks`` of a cache of any KV dtype) into the given block ids
        of ``layers``.

        Blocks of this cache's own dtype are copied bit for bit; others are
        converted (int8 dequantized, floats cast, int8 quantized anew).
        """
        data = self.data[layers]
        head_dim = data.shape[-1]
        wire_head_dim = head_dim + (SCALE_BYTES if blocks.dtype == torch.int8 else 0)
        expected = (*data.shape[:2], len(block_ids), *data.shape[3:5], wire_head_dim)
        if tuple(blocks.shape) != expected:
            raise ValueError(f"imported KV blocks have shape {tuple(blocks.shape)}, expected {expected}")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=data.device)
        blocks = blocks.to(device=data.device)
        if self.scales is None:
            values = blocks if blocks.dtype != torch.int8 else wire_to_float(blocks)
            data.index_copy_(2, index, values.to(dtype=data.dtype))
            return
        if blocks.dtype == torch.int8:
            values, scales = unpack_int8(blocks)
        else:
            values, scales = quantize_int8(blocks)
        data.index_copy_(2, index, values)
        self.scales[layers].index_copy_(2, index, scales)


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, parts: int = 2
) -> int:
    """Bytes of one block of every layer's keys and values (or latents: ``parts`` 1), int8 scales included."""
    element_size = torch.empty((), dtype=dtype).element_size()
    scale_bytes = SCALE_BYTES if dtype == torch.int8 else 0
    return num_layers * parts * block_size * num_kv_heads * (head_dim * element_size + scale_bytes)


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
