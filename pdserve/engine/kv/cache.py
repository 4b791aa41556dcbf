"""The preallocated paged KV pool: one tensor for every layer's keys and values (and their int8 scales)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple
from typing import Sequence as Seq

import numpy as np
import torch

from pdserve.engine.kv.handoff import dtype_name
from pdserve.engine.types.config import KV_CACHE_DTYPES
from pdserve.engine.types.handoff import KV_PARTS, SCALE_BYTES, kv_block_bytes

if TYPE_CHECKING:
    from pdserve.engine.kv.pages import PageLayout

# engine.types.config.KV_CACHE_DTYPES other than "auto" (the model's dtype).
_KV_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "int8": torch.int8}
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

    With a ``PageLayout`` (a model with sliding-window layers, ``engine.kv.pages``)
    the first dimension is the layers of one page and the third the pages
    (``num_blocks`` times the layout's groups); block ids are logical, and
    ``page_map.pages`` (the block manager's) gives each one's page per group.
    Export and import translate; a page a window freed exports as zeros and is
    skipped on import.
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
        layout: PageLayout | None = None,
    ) -> None:
        if not dtype.is_floating_point and dtype != torch.int8:
            raise ValueError(f"KV cache dtype must be floating point or int8, got {dtype}")
        if parts not in KV_PARTS:
            raise ValueError(f"parts must be one of {KV_PARTS}, got {parts}")
        self.layout = layout
        rows, slots = num_layers, num_blocks
        if layout is not None:
            if layout.num_layers != num_layers:
                raise ValueError(f"the page layout has {layout.num_layers} layers, the pool {num_layers}")
            rows, slots = layout.layers_per_page, num_blocks * layout.num_groups
            self._places = [layout.place(layer) for layer in range(num_layers)]
        # Set by the engine with a layout: the block manager, whose ``pages`` maps block ids to pages.
        self.page_map: object | None = None
        # Zeroed, not empty: attention over padded positions multiplies masked
        # (zero) weights by these values, and 0 * NaN from garbage would be NaN.
        self.data = torch.zeros((rows, parts, slots, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.scales = (
            torch.zeros((rows, parts, slots, block_size, num_kv_heads), dtype=torch.float32, device=device)
            if dtype == torch.int8
            else None
        )
        self._num_layers = num_layers
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
        rows = range(self._num_layers) if self.layout is None else [slot for _, slot in self._places]
        if self.scales is None:
            return [(self.data[row][0], self.data[row][value]) for row in rows]
        data, scales = self.data, self.scales
        return [
            (QuantizedKV(data[row][0], scales[row][0]), QuantizedKV(data[row][value], scales[row][value]))
            for row in rows
        ]

    @property
    def parts(self) -> int:
        """Rows per token and layer: 2 (keys and values) or 1 (a latent)."""
        return self.data.shape[1]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one exported block: (num_layers, parts, block_size, num_kv_heads, head_dim [+ 4 for int8])."""
        _, parts, _, block_size, heads, head_dim = self.data.shape
        return (self.num_layers, parts, block_size, heads, head_dim + (SCALE_BYTES if self.is_quantized else 0))

    @property
    def num_layers(self) -> int:
        return self._num_layers

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
        if self.layout is not None:
            blocks, scales = self._export_pages(block_ids, layers)
        else:
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
        first, stop, _ = layers.indices(self.num_layers)
        _, parts, _, _, heads, head_dim = self.data.shape
        wire_head_dim = head_dim + (SCALE_BYTES if blocks.dtype == torch.int8 else 0)
        expected = (stop - first, parts, len(block_ids), self.block_size, heads, wire_head_dim)
        if tuple(blocks.shape) != expected:
            raise ValueError(f"imported KV blocks have shape {tuple(blocks.shape)}, expected {expected}")
        blocks = blocks.to(device=self.data.device)
        if self.layout is not None:
            self._import_pages(block_ids, blocks, range(first, stop))
            return
        data = self.data[layers]
        index = torch.tensor(list(block_ids), dtype=torch.long, device=data.device)
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

    def pages_of(self, block_ids: Seq[int]) -> np.ndarray:
        """(len(block_ids), groups) pages of logical blocks (NO_PAGE: freed by a window), of a paged pool."""
        assert self.page_map is not None, "a paged KV pool needs its block manager's page map"
        return self.page_map.pages[np.asarray(list(block_ids), dtype=np.int64)]  # type: ignore[attr-defined]

    def _export_pages(self, block_ids: Seq[int], layers: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``export_blocks`` of a paged pool, before heads and packing: each layer read from its group's pages,
        the pages a window freed as zeros."""
        pages = self.pages_of(block_ids)
        device = self.data.device
        data_out, scale_out = [], []
        for layer in range(*layers.indices(self.num_layers)):
            group, slot = self._places[layer]
            column = pages[:, group]
            index = torch.from_numpy(np.where(column < 0, 0, column)).to(device)
            freed = torch.from_numpy(column < 0).to(device)
            rows = self.data[slot].index_select(1, index)  # (parts, n, block_size, heads, head_dim)
            rows[:, freed] = 0
            data_out.append(rows)
            if self.scales is not None:
                scales = self.scales[slot].index_select(1, index)
                scales[:, freed] = 0
                scale_out.append(scales)
        return torch.stack(data_out), torch.stack(scale_out) if self.scales is not None else None

    def _import_pages(self, block_ids: Seq[int], blocks: torch.Tensor, layers: range) -> None:
        """``import_blocks`` into a paged pool: each layer into its group's pages, skipping the ones a window freed."""
        if self.scales is None:
            values = (blocks if blocks.dtype != torch.int8 else wire_to_float(blocks)).to(dtype=self.data.dtype)
            scales = None
        elif blocks.dtype == torch.int8:
            values, scales = unpack_int8(blocks)
        else:
            values, scales = quantize_int8(blocks)
        pages = self.pages_of(block_ids)
        device = self.data.device
        for offset, layer in enumerate(layers):
            group, slot = self._places[layer]
            column = pages[:, group]
            kept = torch.from_numpy(np.flatnonzero(column >= 0)).to(device)
            index = torch.from_numpy(column[column >= 0]).to(device)
            self.data[slot].index_copy_(1, index, values[offset].index_select(1, kept))
            if scales is not None:
                assert self.scales is not None
                self.scales[slot].index_copy_(1, index, scales[offset].index_select(1, kept))


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, parts: int = 2
) -> int:
    """Bytes of one block of every layer's keys and values (or latents: ``parts`` 1), int8 scales included."""
    return kv_block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype_name(dtype), parts)


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
