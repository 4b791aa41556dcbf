"""Chained, deterministic block hashes: the prefix-cache key shared by every process.

Pure Python on purpose: the gateway imports this module to compute the hashes of
a prompt without loading torch or the model code. The hash of block ``i`` covers
the hash of block ``i - 1``, the block's token ids and the model identity, so two
prompts share a block hash only when they share the whole prefix up to and
including that block, on the same model.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NewType, Sequence

BlockHash = NewType("BlockHash", bytes)

# Fixed domain-separation seed: bumping it invalidates every cached index entry.
_HASH_SEED = b"pdserve.block-hash.v1"
_ROOT_PARENT = BlockHash(b"")


def adapter_model_id(model_id: str, lora_name: str | None) -> str:
    """The model identity a request's blocks are hashed under: the base's, or the base's with its LoRA adapter's
    name (a prefix computed under one adapter is never another's, or the base's)."""
    return model_id if not lora_name else f"{model_id}+lora:{lora_name}"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], model_id: str) -> BlockHash:
    """Hash of one full block given the hash of the block before it (``None`` for the first)."""
    digest = hashlib.blake2b(_HASH_SEED, digest_size=16)
    parent_bytes = parent if parent is not None else _ROOT_PARENT
    model_bytes = model_id.encode("utf-8")
    digest.update(struct.pack("<I", len(model_bytes)))
    digest.update(model_bytes)
    digest.update(struct.pack("<I", len(parent_bytes)))
    digest.update(parent_bytes)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return BlockHash(digest.digest())


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, model_id: str) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, in order; a partial last block is not hashed."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], model_id)
        hashes.append(parent)
    return hashes
