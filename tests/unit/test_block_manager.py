"""Block accounting on tiny pools: exact block ids, ref counts, prefix hits and eviction order."""

from __future__ import annotations

from pdserve.engine.kv.block_manager import BlockManager, BlockRemoved, BlockStored
from pdserve.engine.sequence import Sequence
from pdserve.engine.types.hashing import hash_prompt_blocks
from pdserve.engine.types.sampling_params import SamplingParams

MODEL = "tiny"
BS = 4


def _seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams(max_tokens=4), BS, MODEL)


def _run_prefill(manager: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` with its prefix hit and mark every prompt token computed."""
    computed, num_cached = manager.get_computed_blocks(seq)
    manager.allocate(seq, seq.num_tokens - num_cached, computed)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_computed_blocks(seq)


def test_allocation_hands_out_blocks_in_order_and_free_returns_them() -> None:
    manager = BlockManager(num_blocks=6, block_size=BS)
    a = _seq("a", list(range(10)))
    _run_prefill(manager, a)
    assert a.block_table == [0, 1, 2]
    assert manager.num_free_blocks == 3
    assert manager.drain_events() == [BlockStored(tuple(hash_prompt_blocks(list(range(10)), BS, MODEL)))]
    manager.free(a)
    # The partial block (no hash) goes first in line for reuse; cached blocks go
    # last, the sequence's tail before its head.
    assert manager.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert manager.num_cached_blocks == 2
    assert a.block_table == [] and a.num_computed_tokens == 0


def test_prefix_hit_reuses_blocks_and_shares_ref_counts() -> None:
    manager = BlockManager(num_blocks=6, block_size=BS)
    a = _seq("a", list(range(10)))
    _run_prefill(manager, a)
    b = _seq("b", list(range(8)) + [50, 51, 52])
    computed, num_cached = manager.get_computed_blocks(b)
    assert (computed, num_cached) == ([0, 1], 8)
    manager.allocate(b, 3, computed)
    assert b.block_table == [0, 1, 3]
    assert [manager.ref_count(i) for i in range(6)] == [2, 2, 1, 1, 0, 0]
    manager.free(a)
    assert [manager.ref_count(i) for i in range(6)] == [1, 1, 0, 1, 0, 0]
    manager.free(b)
    assert manager.num_free_blocks == 6


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    manager = BlockManager(num_blocks=6, block_size=BS)
    a = _seq("a", list(range(8)))
    _run_prefill(manager, a)
    manager.free(a)
    again = _seq("again", list(range(8)))
    # Two full blocks cached, but the last token must run to produce logits.
    assert manager.get_computed_blocks(again) == ([0], 4)


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed() -> None:
    manager = BlockManager(num_blocks=6, block_size=BS)
    a = _seq("a", list(range(10)))
    _run_prefill(manager, a)
    manager.free(a)
    manager.drain_events()
    d = _seq("d", list(range(100, 118)))  # 5 blocks, nothing shared
    assert manager.can_allocate(d, 18)
    manager.allocate(d, 18)
    # 2, 3, 4, 5 are free without a hash; then block 1 (a's tail) is evicted.
    assert d.block_table == [2, 3, 4, 5, 1]
    hashes = hash_prompt_blocks(list(range(10)), BS, MODEL)
    assert manager.drain_events() == [BlockRemoved((hashes[1],))]
    assert manager.cached_block_id(hashes[0]) == 0
    assert manager.cached_block_id(hashes[1]) is None
    e = _seq("e", list(range(10)))
    assert manager.get_computed_blocks(e) == ([0], 4)


def test_can_allocate_counts_cached_blocks_taken_from_the_free_queue() -> None:
    manager = BlockManager(num_blocks=3, block_size=BS)
    a = _seq("a", list(range(9)))
    _run_prefill(manager, a)
    manager.free(a)
    b = _seq("b", list(range(8)) + [60, 61, 62, 63, 64])
    computed, _ = manager.get_computed_blocks(b)
    assert computed == [0, 1]
    # 2 cached blocks leave the free queue + 2 new blocks = 4 > 3.
    assert not manager.can_allocate(b, 5, computed)
    assert manager.can_allocate(b, 4, computed)


def test_append_grows_a_block_exactly_at_the_boundary() -> None:
    manager = BlockManager(num_blocks=3, block_size=BS)
    a = _seq("a", [1, 2, 3, 4])
    _run_prefill(manager, a)
    assert a.block_table == [0]
    a.append_token(5)
    assert manager.can_append(a, 1)
    manager.append(a, 1)
    assert a.block_table == [0, 1]
    a.num_computed_tokens = 5
    a.append_token(6)
    manager.append(a, 1)
    assert a.block_table == [0, 1]


def test_prefix_caching_disabled_never_hits_nor_emits_events() -> None:
    manager = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    a = _seq("a", list(range(10)))
    _run_prefill(manager, a)
    manager.free(a)
    assert manager.get_computed_blocks(_seq("b", list(range(10)))) == ([], 0)
    assert manager.drain_events() == []
    assert manager.num_cached_blocks == 0


def test_identical_prompts_admitted_together_keep_one_cached_copy() -> None:
    manager = BlockManager(num_blocks=8, block_size=BS)
    a, b = _seq("a", list(range(8))), _seq("b", list(range(8)))
    manager.allocate(a, 8)
    manager.allocate(b, 8)
    for seq in (a, b):
        seq.num_computed_tokens = 8
        manager.cache_computed_blocks(seq)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    hashes = hash_prompt_blocks(list(range(8)), BS, MODEL)
    assert [manager.cached_block_id(h) for h in hashes] == [0, 1]
    assert manager.drain_events() == [BlockStored(tuple(hashes))]
    manager.free(b)
    manager.free(a)
    # b's duplicate blocks hold nothing reusable and are reused first.
    assert manager.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
