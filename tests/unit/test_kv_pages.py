"""Pages behind sliding windows: layer groups, exact page ids freed and reused, prefix hits, imports, the pool."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv.block_manager import BlockRemoved
from pdserve.engine.kv.cache import KVCache
from pdserve.engine.kv.pages import NO_PAGE, PagedBlockManager, PageLayout
from pdserve.engine.sequence import Sequence
from pdserve.engine.types.handoff import KVReservation
from pdserve.engine.types.sampling_params import SamplingParams

MODEL = "tiny"
BS = 4
# Layer 0 full attention, layer 1 sliding by 8: two groups of one layer, the full one first.
LAYOUT = PageLayout.of([None, 8])


def _seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams(max_tokens=4), BS, MODEL)


def _compute(manager: PagedBlockManager, seq: Sequence) -> None:
    """Admit ``seq`` with its prefix hit, compute every token, then let the window move on (as a step does)."""
    computed, num_cached = manager.get_computed_blocks(seq)
    manager.allocate(seq, seq.num_tokens - num_cached, computed)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_computed_blocks(seq)
    manager.trim(seq)


def _decode(manager: PagedBlockManager, seq: Sequence, token: int) -> None:
    seq.append_token(token)
    manager.append(seq, 1)
    seq.num_computed_tokens += 1
    manager.cache_computed_blocks(seq)
    manager.trim(seq)


def test_layouts_group_layers_of_one_kind_into_equal_pages() -> None:
    # Gemma 3's pattern: five sliding layers, then a global one; 10 sliding and 2 full make pages of 2 layers.
    gemma3 = PageLayout.of(([512] * 5 + [None]) * 2)
    assert gemma3 is not None
    assert gemma3.layers_per_page == 2
    assert gemma3.groups == ((5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10))
    assert gemma3.sliding == (False, True, True, True, True, True)
    assert gemma3.window == 512
    assert gemma3.place(11) == (0, 1) and gemma3.place(6) == (3, 1)
    # Every layer slides (Mistral): one group, a page is a whole block.
    mistral = PageLayout.of([4096] * 3)
    assert mistral is not None and mistral.groups == ((0, 1, 2),) and mistral.sliding == (True,)
    # Different windows: the sliding groups keep the largest.
    assert PageLayout.of([64, None, 128, None]).window == 128  # type: ignore[union-attr]
    assert PageLayout.of([None, None]) is None
    # The next query at position 20 with a window of 8 reads positions 13.. : blocks 3.. of 4 tokens.
    assert LAYOUT is not None and LAYOUT.first_needed_block(20, BS) == 3
    assert LAYOUT.first_needed_block(7, BS) == 0


def test_sliding_pages_behind_the_window_are_freed_and_reused() -> None:
    assert LAYOUT is not None
    # Without prefix caching a page nobody needs is freed at once.
    manager = PagedBlockManager(num_blocks=8, block_size=BS, layout=LAYOUT, enable_prefix_caching=False)
    assert manager.num_pages == 16 and manager.num_free_blocks == 8
    a = _seq("a", list(range(20)))
    _compute(manager, a)
    assert a.block_table == [0, 1, 2, 3, 4]
    # Block 0 took pages 0 (full) and 1 (sliding), block 1 pages 2 and 3, ...; the next query (position 20)
    # reads positions 13.. in the sliding layer, so blocks 0-2 gave their sliding pages back.
    assert manager.pages[:5].tolist() == [[0, NO_PAGE], [2, NO_PAGE], [4, NO_PAGE], [6, 7], [8, 9]]
    assert manager.num_pages_held(a) == 7 and manager.num_free_pages == 9
    # The freed pages are the next ones taken (last freed first).
    b = _seq("b", [100 + t for t in range(4)])
    _compute(manager, b)
    assert manager.pages[b.block_table].tolist() == [[5, 3]]
    # Decoding moves the window on: position 24 reads 17.. , so block 3 gives its sliding page too.
    for token in (20, 21, 22, 23):
        _decode(manager, a, token)
    assert a.block_table == [0, 1, 2, 3, 4, 6]  # b took block 5
    assert manager.pages[a.block_table].tolist() == [
        [0, NO_PAGE], [2, NO_PAGE], [4, NO_PAGE], [6, NO_PAGE], [8, 9], [1, 10]
    ]
    manager.free(b)
    manager.free(a)
    assert manager.num_free_blocks == 8 and manager.num_free_pages == 16 and manager.held_block_ids() == []


def test_a_cached_blocks_sliding_pages_stay_reclaimable_until_the_pool_takes_them() -> None:
    assert LAYOUT is not None
    manager = PagedBlockManager(num_blocks=8, block_size=BS, layout=LAYOUT)
    a = _seq("a", list(range(20)))
    _compute(manager, a)
    # Blocks 0-2 cache a prefix: their sliding pages (1, 3, 5) stay with them, reclaimable.
    assert manager.pages[:5].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert (manager.num_pages_held(a), manager.num_reclaimable_pages, manager.num_free_pages) == (7, 3, 6)
    assert manager.num_free_blocks == 4
    # So a prompt sharing a's first 12 tokens hits 3 blocks: the sliding layer reads blocks 1 and 2 at position 12.
    prompt = list(range(12)) + [7]
    assert manager.get_computed_blocks(_seq("c", prompt)) == ([0, 1, 2], 12)
    # Free pages go first (10, 11), then the reclaimable ones, least recently let go first (1, 3).
    b = _seq("b", [100 + t for t in range(12)])
    _compute(manager, b)
    assert manager.pages[b.block_table].tolist() == [[10, 11], [12, 13], [14, 15]]
    d = _seq("d", [200 + t for t in range(4)])
    _compute(manager, d)
    assert manager.pages[d.block_table].tolist() == [[1, 3]]
    assert manager.pages[:3].tolist() == [[0, NO_PAGE], [2, NO_PAGE], [4, 5]]
    # Now a 3-block hit would read block 1, a 2-block one blocks 0 and 1, a 1-block one block 0: none is left.
    assert manager.get_computed_blocks(_seq("c", prompt)) == ([], 0)
    # The whole of a's prompt still hits: its window (blocks 3 and 4) is intact.
    assert manager.get_computed_blocks(_seq("e", list(range(20)) + [7])) == ([0, 1, 2, 3, 4], 20)


def test_a_block_shared_with_a_sequence_that_still_reads_it_keeps_its_sliding_page() -> None:
    assert LAYOUT is not None
    manager = PagedBlockManager(num_blocks=16, block_size=BS, layout=LAYOUT)
    a = _seq("a", list(range(9)))
    _compute(manager, a)  # the next query at 9 reads 2.. : blocks 0-2, all needed
    b = _seq("b", list(range(8)) + [50])
    _compute(manager, b)  # hit on blocks 0 and 1
    assert b.block_table[:2] == [0, 1]
    for token in range(9, 17):
        _decode(manager, a, token)
    # a reads 10.. now (its blocks 2-4); b still reads blocks 0-2: blocks 0 and 1 keep needing their pages.
    assert a.block_table == [0, 1, 2, 4, 5]
    assert manager.num_reclaimable_pages == 0 and manager.num_pages_held(a) == 10
    manager.free(b)
    # b was the last reader of blocks 0 and 1 in the sliding layer: their pages 1 and 3 are reclaimable now.
    assert manager.num_reclaimable_pages == 2 and manager.num_pages_held(a) == 8
    manager.free(a)
    assert manager.num_free_blocks == 16 and manager.held_block_ids() == []


def test_cached_blocks_are_reclaimed_page_by_page_when_the_pool_runs_dry() -> None:
    assert LAYOUT is not None
    manager = PagedBlockManager(num_blocks=4, block_size=BS, layout=LAYOUT)
    a = _seq("a", list(range(12)))
    _compute(manager, a)  # blocks 0-2, pages (0, 1), (2, 3), (4, 5); the next query at 12 reads 5..
    manager.free(a)
    # Let go of: block 0's sliding page (the window passed it), then the other sliding pages, then the full
    # pages from the tail. 6 reclaimable pages and 2 free ones: 4 blocks' worth.
    assert manager.num_cached_blocks == 3 and manager.num_free_blocks == 4
    assert manager.free_block_ids() == [0, 1, 2]
    manager.drain_events()
    b = _seq("b", [200 + t for t in range(12)])
    assert manager.can_allocate(b, 12)
    _compute(manager, b)
    # 6 pages: the free ones (6, 7), then reclaimed 1, 3, 5 (sliding: blocks 0-2 stay cached) and 4, block
    # 2's full page, which takes block 2 out of the cache.
    assert b.block_table == [3, 4, 5]
    assert manager.pages[b.block_table].tolist() == [[6, 7], [1, 3], [5, 4]]
    removed = [event for event in manager.drain_events() if isinstance(event, BlockRemoved)]
    assert removed == [BlockRemoved((a.block_hashes()[2],))]
    assert manager.num_cached_blocks == 5 and manager.free_block_ids() == [1, 0]
    assert manager.pages[[0, 1]].tolist() == [[0, NO_PAGE], [2, NO_PAGE]]


def test_an_import_gives_blocks_before_the_window_full_layer_pages_only() -> None:
    assert LAYOUT is not None
    manager = PagedBlockManager(num_blocks=8, block_size=BS, layout=LAYOUT)
    seq = _seq("r", list(range(20)))
    assert manager.can_import(seq, seq.block_hashes(), 20)
    to_fill = manager.allocate_imported(seq, seq.block_hashes(), 20)
    assert to_fill == [0, 1, 2, 3, 4]
    # Blocks 0-2 lie before the window of the next query (position 20): one page each.
    assert manager.num_pages_held(seq) == 7
    assert [manager.pages[b, 1] == NO_PAGE for b in seq.block_table] == [True, True, True, False, False]
    manager.free(seq)
    assert manager.num_free_blocks == 8


def test_pushed_blocks_before_the_window_give_their_sliding_pages_back_when_adopted() -> None:
    assert LAYOUT is not None
    manager = PagedBlockManager(num_blocks=8, block_size=BS, layout=LAYOUT)
    seq = _seq("r", list(range(20)))
    seq.kv_reservation = KVReservation(0, tuple(manager.reserve(5)))
    assert manager.num_free_pages == 6
    assert manager.allocate_imported(seq, seq.block_hashes(), 20) == []
    assert manager.num_pages_held(seq) == 7 and manager.num_free_pages == 9
    manager.free(seq)
    assert manager.num_free_blocks == 8


def test_a_paged_pool_exports_freed_pages_as_zeros_and_skips_them_on_import() -> None:
    assert LAYOUT is not None
    manager = PagedBlockManager(num_blocks=4, block_size=BS, layout=LAYOUT, enable_prefix_caching=False)
    cache = KVCache(2, 4, BS, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                    layout=LAYOUT)
    cache.page_map = manager
    assert tuple(cache.data.shape) == (1, 2, 8, BS, 1, 2)  # one layer per page, 8 pages
    seq = _seq("a", list(range(12)))
    _compute(manager, seq)  # block 0 lost its sliding page
    # Fill every page with its own id, then read the sequence's blocks back in the wire layout.
    cache.data.copy_(torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1, 1, 1).expand_as(cache.data))
    exported = cache.export_blocks(seq.block_table)
    assert tuple(exported.shape) == (2, 2, 3, BS, 1, 2)
    full, sliding = manager.pages[seq.block_table].T.tolist()
    assert exported[0, :, :, 0, 0, 0].tolist() == [full, full]
    assert exported[1, :, :, 0, 0, 0].tolist() == [[0.0, sliding[1], sliding[2]]] * 2
    # An import writes every page the blocks hold and nothing where a window freed one.
    cache.data.zero_()
    cache.import_blocks(seq.block_table, exported + 100)
    assert cache.data[0, 0, :, 0, 0, 0].tolist() == [
        100.0 + page if page in full + sliding[1:] else 0.0 for page in range(8)
    ]
    # One layer at a time (a push's pieces).
    assert torch.equal(cache.export_blocks(seq.block_table, slice(1, 2)), (exported + 100)[1:] * torch.tensor(
        [0.0, 1.0, 1.0]).view(1, 1, 3, 1, 1, 1))


def test_a_layout_must_cover_the_pools_layers() -> None:
    with pytest.raises(ValueError, match="the page layout has 2 layers, the pool 3"):
        KVCache(3, 4, BS, 1, 2, torch.float32, torch.device("cpu"), layout=LAYOUT)


def test_an_import_reuses_cached_blocks_whose_sliding_pages_its_window_does_not_read() -> None:
    assert LAYOUT is not None
    manager = PagedBlockManager(num_blocks=8, block_size=BS, layout=LAYOUT)
    a = _seq("a", list(range(20)))
    _compute(manager, a)
    manager.free(a)
    # 10 pages for b: the 6 free ones, then a's sliding pages of blocks 0-3, least recently let go first.
    b = _seq("b", [100 + t for t in range(20)])
    _compute(manager, b)
    assert manager.pages[:5, 1].tolist() == [NO_PAGE, NO_PAGE, NO_PAGE, NO_PAGE, 9]
    # Imported with 24 tokens, the next query at 24 reads blocks 4 and 5 in the sliding layer: blocks 0-3 are
    # reused for their full-layer pages, block 4 with its sliding page too; only block 5 arrives.
    seq = _seq("r", list(range(20)) + [7, 7, 7, 7])
    assert manager.can_import(seq, seq.block_hashes(), 24)
    assert manager.allocate_imported(seq, seq.block_hashes(), 24) == [5]
    assert seq.block_table[:5] == [0, 1, 2, 3, 4] and manager.num_pages_held(seq) == 8
    manager.free(seq)
    manager.free(b)
    assert manager.held_block_ids() == [] and manager.num_free_blocks == 8


def test_where_every_layer_slides_a_hit_needs_only_the_blocks_its_window_reads() -> None:
    # Two layers sliding by 8: one group, a page is a whole block (Mistral's shape).
    layout = PageLayout.of([8, 8])
    assert layout is not None and layout.num_groups == layout.num_sliding_groups == 1
    manager = PagedBlockManager(num_blocks=6, block_size=BS, layout=layout)
    a = _seq("a", list(range(24)))
    _compute(manager, a)
    manager.free(a)  # blocks 0-5 cached; their pages reclaimable, blocks 0-3 (let go first) first
    b = _seq("b", [100 + t for t in range(12)])
    _compute(manager, b)  # takes pages 0-2 back: a's blocks 0-2 leave the cache
    assert manager.pages[b.block_table].tolist() == [[0], [1], [2]]
    assert [type(event).__name__ for event in manager.drain_events()] == ["BlockStored"] + ["BlockRemoved"] * 3 + [
        "BlockStored"
    ]
    # a's prompt and 4 tokens more: the next query (position 24) reads positions 17.. , blocks 4 and 5, which
    # are cached with their pages; the blocks before them need nothing.
    c = _seq("c", list(range(24)) + [50, 51, 52, 53])
    computed, num_cached = manager.get_computed_blocks(c)
    assert (computed, num_cached) == ([NO_PAGE] * 4 + [4, 5], 24)
    manager.allocate(c, c.num_tokens - num_cached, computed)
    # Four blocks without pages, a's blocks 4 and 5, and a new block (a's block 3's page, reclaimed).
    assert c.block_table == [2, 7, 8, 9, 4, 5, 10] and c.num_computed_tokens == 24
    assert manager.pages[c.block_table].tolist() == [[NO_PAGE]] * 4 + [[4], [5], [3]]
    c.num_computed_tokens = c.num_tokens
    manager.cache_computed_blocks(c)
    manager.trim(c)
    assert manager.num_pages_held(c) == 2  # position 28 reads 21.. : blocks 5 and 6
    manager.free(c)
    manager.free(b)
    assert manager.held_block_ids() == [] and manager.num_free_pages + manager.num_reclaimable_pages == 6
    assert {2, 7, 8, 9} <= set(manager._free_ids)  # the pageless blocks went back (never cached)
    # Once d has taken a's last pages back, the blocks the window reads are gone: no hit at all.
    d = _seq("d", [200 + t for t in range(20)])
    _compute(manager, d)
    assert manager.get_computed_blocks(_seq("e", list(range(24)) + [60]))[1] == 0
    # A layout with full layers keeps the left-to-right lookup: blocks before the window need their full pages.
    assert LAYOUT is not None and LAYOUT.num_sliding_groups < LAYOUT.num_groups
