"""The lease table, the one owner of held KV: exports while held, frees on release or expiry, nothing after."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVCache
from pdserve.engine.kv.leases import LeaseTable
from pdserve.engine.sequence import Sequence
from pdserve.engine.types.handoff import KVHandoff, KVLayout
from pdserve.engine.types.hashing import hash_prompt_blocks
from pdserve.engine.types.sampling_params import SamplingParams

BS, NUM_BLOCKS = 4, 8
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype="float32")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _held(manager: BlockManager, cache: KVCache, request_id: str, num_tokens: int) -> tuple[Sequence, KVHandoff]:
    """A finished prefill whose blocks were not freed, its KV filled with the block ids."""
    prompt = list(range(num_tokens))
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=1), BS, "tiny")
    manager.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    for block_id in seq.block_table:
        cache.data[:, :, block_id] = float(block_id)
    handoff = KVHandoff(
        request_id=request_id, model_id="tiny", layout=LAYOUT,
        block_hashes=tuple(hash_prompt_blocks(prompt, BS, "tiny")), num_tokens=num_tokens, first_token_id=7,
        transport="grpc", address="127.0.0.1:1", lease_deadline_ms=0, worker_id="p", epoch=1,
    )
    return seq, handoff


@pytest.fixture
def table() -> tuple[LeaseTable, BlockManager, KVCache, _Clock, list[str]]:
    manager = BlockManager(NUM_BLOCKS, BS)
    cache = KVCache(1, NUM_BLOCKS, BS, 1, 2, torch.float32, torch.device("cpu"))
    clock, ended = _Clock(), []
    leases = LeaseTable(manager, cache, 1.0, clock)  # every lease: 1 s
    leases.on_end = ended.append
    return leases, manager, cache, clock, ended


def test_held_blocks_export_from_any_first_block_until_released(table) -> None:  # noqa: ANN001
    leases, manager, cache, _, ended = table
    seq, handoff = _held(manager, cache, "a", 10)  # blocks 0, 1, 2
    leases.grant(seq, handoff)
    assert "a" in leases and len(leases) == 1 and manager.num_free_blocks == NUM_BLOCKS - 3
    assert leases.export("a", 1)[0, 0, :, 0, 0, 0].tolist() == [1.0, 2.0]
    assert leases.export("a", 3).shape == (1, 2, 0, BS, 1, 2)
    with pytest.raises(ValueError, match="first_block"):
        leases.export("a", 4)
    assert leases.release("a") is True
    assert manager.num_free_blocks == NUM_BLOCKS and ended == ["a"] and len(leases) == 0
    with pytest.raises(KeyError, match="holds no KV"):
        leases.export("a", 0)
    # A second release (ReleaseKV after expiry, abort after release) changes nothing.
    assert leases.release("a") is False and ended == ["a"]


def test_leases_expire_at_their_deadline_and_free_the_blocks(table) -> None:  # noqa: ANN001
    leases, manager, cache, clock, ended = table
    seq_a, handoff_a = _held(manager, cache, "a", 5)
    leases.grant(seq_a, handoff_a)
    clock.now += 0.5
    seq_b, handoff_b = _held(manager, cache, "b", 5)
    leases.grant(seq_b, handoff_b)
    assert leases.expire() == [] and manager.num_free_blocks == NUM_BLOCKS - 4
    clock.now += 0.5
    assert leases.expire() == ["a"]
    assert leases.request_ids == ["b"] and manager.num_free_blocks == NUM_BLOCKS - 2
    clock.now += 0.5
    assert leases.expire() == ["b"]
    assert leases.num_expired == 2 and ended == ["a", "b"] and manager.num_free_blocks == NUM_BLOCKS


def test_release_all_frees_every_held_request(table) -> None:  # noqa: ANN001
    leases, manager, cache, _, ended = table
    for request_id in ("a", "b"):
        leases.grant(*_held(manager, cache, request_id, 6))
    leases.release_all()
    assert len(leases) == 0 and ended == ["a", "b"] and manager.num_free_blocks == NUM_BLOCKS
    assert leases.num_expired == 0
