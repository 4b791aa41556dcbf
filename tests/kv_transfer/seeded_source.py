"""A deterministic KVSource shared by the test sender process and the tests that check what arrived."""

from __future__ import annotations

import dataclasses
import zlib

import torch

from pdserve.engine.kv.cache import pack_int8, quantize_int8
from pdserve.engine.kv.handoff import torch_dtype_of
from pdserve.kv_transfer.descriptor import KVLayout

# 32 KiB per block: a few blocks stay small, BIG_REQUEST spans several 1 MiB chunks.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, block_size=16, dtype="float32")
SMALL_REQUEST, BIG_REQUEST = "small", "big"
# The same in the compact KV dtypes (int8 blocks carry their scales, packed).
BF16_REQUEST, INT8_REQUEST = "big-bfloat16", "big-int8"
NUM_BLOCKS = {SMALL_REQUEST: 3, BIG_REQUEST: 80, BF16_REQUEST: 80, INT8_REQUEST: 80}  # big: 2.5 MiB in float32
LAYOUTS = {
    BF16_REQUEST: dataclasses.replace(LAYOUT, dtype="bfloat16"),
    INT8_REQUEST: dataclasses.replace(LAYOUT, dtype="int8"),
}


def layout_of(request_id: str) -> KVLayout:
    return LAYOUTS.get(request_id, LAYOUT)


def full_blocks(request_id: str) -> torch.Tensor:
    """Every block of ``request_id``, from a seed derived from its name (the same in every process)."""
    generator = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
    layout = layout_of(request_id)
    shape = LAYOUT.tensor_shape(NUM_BLOCKS[request_id])
    values = torch.randn(shape, generator=generator)
    if layout.dtype == "int8":
        return pack_int8(*quantize_int8(values))
    return values.to(torch_dtype_of(layout))


class SeededSource:
    """Holds the requests of ``NUM_BLOCKS``; anything else is not held (KeyError)."""

    num_layers = LAYOUT.num_layers

    def export(
        self, request_id: str, first_block: int, layers: slice = slice(None), heads: range | None = None
    ) -> torch.Tensor:
        if request_id not in NUM_BLOCKS:
            raise KeyError(f"request {request_id!r} is not held")
        if not 0 <= first_block <= NUM_BLOCKS[request_id]:
            raise ValueError(f"first_block {first_block} is past the {NUM_BLOCKS[request_id]} blocks held")
        heads = LAYOUT.check_heads(heads)
        return full_blocks(request_id)[layers, :, first_block:, :, heads.start : heads.stop].clone()
