"""Zero-copy byte views of KV tensors, for the transports that move raw bytes (grpc, shm)."""

from __future__ import annotations

import torch

from pdserve.engine.kv.handoff import torch_dtype_of
from pdserve.kv_transfer.descriptor import KVLayout


def host_contiguous(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` on the CPU and contiguous; no copy when it already is."""
    return blocks.detach().to("cpu").contiguous()


def byte_view(blocks: torch.Tensor) -> memoryview:
    """A flat, writable byte view of a contiguous CPU tensor, sharing its memory.

    Goes through a uint8 view because numpy has no bfloat16.
    """
    if blocks.device.type != "cpu" or not blocks.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return memoryview(blocks.reshape(-1).view(torch.uint8).numpy())


def empty_blocks(layout: KVLayout, num_blocks: int, num_heads: int | None = None) -> torch.Tensor:
    """An uninitialised CPU tensor of ``layout.tensor_shape(num_blocks, num_heads)`` to receive into."""
    return torch.empty(layout.tensor_shape(num_blocks, num_heads), dtype=torch_dtype_of(layout))
