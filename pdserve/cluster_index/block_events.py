"""Coalescing a worker's block events into one net change to publish.

The engine emits ``BlockStored`` / ``BlockRemoved`` in order; a hash can be
stored, evicted and stored again between two publishes. Publishing the net state
of each hash makes the published sets disjoint, so their order no longer matters.
The engine's event classes are not imported (``engine.kv.block_manager`` pulls in
torch); the worker passes ``stored=isinstance(event, BlockStored)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.engine.types.hashing import BlockHash


@dataclass(frozen=True)
class BlockChanges:
    """Net change of one worker's cached blocks: disjoint ``stored`` and ``removed``."""

    stored: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()

    def __post_init__(self) -> None:
        overlap = set(self.stored) & set(self.removed)
        if overlap:
            raise ValueError(f"{len(overlap)} block hashes are both stored and removed; coalesce with BlockEventBatch")

    def __len__(self) -> int:
        return len(self.stored) + len(self.removed)


class BlockEventBatch:
    """Accumulates block events in order; ``drain()`` returns the net change and empties the batch."""

    def __init__(self) -> None:
        # dicts keep insertion order: hashes are published in the order first seen.
        self._cached: dict[BlockHash, bool] = {}

    def add(self, stored: bool, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in block_hashes:
            # Re-insert so the latest event for a hash decides its position too.
            self._cached.pop(block_hash, None)
            self._cached[block_hash] = stored

    def __len__(self) -> int:
        return len(self._cached)

    def drain(self) -> BlockChanges:
        changes = BlockChanges(
            stored=tuple(h for h, cached in self._cached.items() if cached),
            removed=tuple(h for h, cached in self._cached.items() if not cached),
        )
        self._cached.clear()
        return changes
