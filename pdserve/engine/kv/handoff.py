"""The torch side of a KV handoff: the tensor dtype of a ``KVLayout``, and what lands one across ranks.

The descriptors themselves (``KVLayout``, ``KVHandoff``) are torch-free value
types in ``pdserve.engine.types.handoff``; the transports and the pool need
their tensors' dtype, and a tensor-parallel decode engine lands a handoff as a
``KVFetch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.types.handoff import KV_PARTS, SCALE_BYTES, KVHandoff, KVLayout

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}


def torch_dtype_of(layout: KVLayout) -> torch.dtype:
    """The dtype of the tensors that carry ``layout``'s blocks (int8's scales travel inside them as bytes)."""
    return _TORCH_DTYPES[layout.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name as a ``KVLayout`` writes it ("bfloat16"); ValueError for a dtype KV is never kept in."""
    for name, value in _TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"KV is never kept in {dtype}; one of {sorted(_TORCH_DTYPES)}")


def layout_of(blocks: torch.Tensor) -> KVLayout:
    """The layout of an exported (num_layers, kv_parts, n, block_size, num_kv_heads, row_size) tensor."""
    if blocks.dim() != 6 or blocks.shape[1] not in KV_PARTS:
        raise ValueError(
            f"KV blocks must be (layers, 2 or 1, blocks, block_size, heads, head_dim), got {tuple(blocks.shape)}"
        )
    num_layers, parts, _, block_size, num_kv_heads, row_size = blocks.shape
    head_dim = row_size - (SCALE_BYTES if blocks.dtype == torch.int8 else 0)
    return KVLayout(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        dtype=dtype_name(blocks.dtype), kv_parts=parts,
    )


@dataclass(frozen=True)
class KVFetch:
    """What lands a handoff on a tensor-parallel decode engine instead of one tensor of every head.

    Each rank receives exactly the KV heads it owns, straight from the sender:
    ``local_blocks`` are rank 0's heads (fetched by the service like any
    handoff), and every other rank calls ``fetcher(handoff, first_block, heads)``
    for its own heads. The fetcher is the transport layer's, passed in by the
    service (the engine imports no transport); it crosses to the other ranks'
    processes pickled, so it must be a module-level function or a
    ``functools.partial`` of one.
    """

    handoff: KVHandoff
    local_blocks: torch.Tensor  # (num_layers, 2, n, block_size, rank 0's KV heads, row_size)
    fetcher: Callable[[KVHandoff, int, range], torch.Tensor]
