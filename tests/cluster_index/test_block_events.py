from __future__ import annotations

import pytest

from pdserve.cluster_index import BlockChanges, BlockEventBatch
from pdserve.engine.types.hashing import BlockHash

A, B, C, D = (BlockHash(bytes([i]) * 16) for i in range(4))


def test_batch_publishes_the_net_state_of_each_hash_in_order() -> None:
    batch = BlockEventBatch()
    batch.add(True, [A, B])
    batch.add(False, [A])  # evicted after being stored: net removed
    batch.add(True, [C])
    batch.add(False, [D])
    batch.add(True, [D])  # evicted, then stored again: net stored
    assert len(batch) == 4
    assert batch.drain() == BlockChanges(stored=(B, C, D), removed=(A,))
    assert len(batch) == 0
    assert batch.drain() == BlockChanges()


def test_changes_reject_overlap() -> None:
    with pytest.raises(ValueError, match="1 block hashes are both stored and removed"):
        BlockChanges(stored=(A, B), removed=(B,))
