"""KV pages for models with sliding-window layers: what a window has left behind is freed in those layers.

A sliding layer (Mistral, Gemma 2/3's local layers, Phi-3 and Qwen with
``sliding_window``) only ever reads the last ``window`` positions; the blocks
before them are dead weight in that layer. As vLLM's hybrid allocator does, the
pool is cut into equal pages of ``layers_per_page`` layers each, and the layers
into groups of that many layers of one kind (full or sliding). A block of a
sequence (the id in its block table, a *logical* block here) holds one page per
group; once every sequence that holds it has moved past it by a window, its
sliding groups' pages go back to the pool, and only the full layers' pages stay
(none, for a model whose layers all slide).

What stays the same for the rest of the engine: a block table lists logical
block ids, the prefix cache maps block hashes to them, a handoff exports and
imports them in the usual wire layout (the pages a window freed travel as
zeros, and the receiver frees them again). Translation to pages happens where
the cache is read and written: ``KVCache`` (export, import) and the model
runner (each group's block tables and slots).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np

from pdserve.engine.kv.block_manager import BlockManager, BlockRemoved
from pdserve.engine.sequence import Sequence
from pdserve.engine.types.hashing import BlockHash

# A page table entry where a window freed the page.
NO_PAGE = -1


@dataclass(frozen=True)
class PageLayout:
    """Which layers share a page: ``groups`` of ``layers_per_page`` layers, full-attention groups first.

    ``window``: the window the sliding groups keep (the largest, where layers slide by different windows).
    """

    num_layers: int
    layers_per_page: int
    groups: tuple[tuple[int, ...], ...]
    sliding: tuple[bool, ...]
    window: int

    @classmethod
    def of(cls, windows: Seq[int | None]) -> PageLayout | None:
        """The layout for layers with these windows (None: full attention); None when no layer slides."""
        sliding = [index for index, window in enumerate(windows) if window is not None]
        if not sliding:
            return None
        full = [index for index, window in enumerate(windows) if window is None]
        size = math.gcd(len(full), len(sliding))
        groups = [tuple(layers[i : i + size]) for layers in (full, sliding) for i in range(0, len(layers), size)]
        return cls(
            num_layers=len(windows),
            layers_per_page=size,
            groups=tuple(groups),
            sliding=tuple(index >= len(full) // size for index in range(len(groups))),
            window=max(int(windows[i]) for i in sliding),  # type: ignore[arg-type]
        )

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_sliding_groups(self) -> int:
        return sum(self.sliding)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot within the page) of ``layer``."""
        for group, layers in enumerate(self.groups):
            if layer in layers:
                return group, layers.index(layer)
        raise ValueError(f"layer {layer} is outside the layout's {self.num_layers} layers")

    def first_needed_block(self, num_tokens: int, block_size: int) -> int:
        """The first block the sliding layers still read when the next query sits at position ``num_tokens``:
        it sees positions from ``num_tokens - window + 1`` on."""
        return max(0, num_tokens - self.window + 1) // block_size


class _LogicalBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "window_refs")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        # Holders that still read this block in the sliding layers.
        self.window_refs = 0


class PagedBlockManager(BlockManager):
    """A ``BlockManager`` whose blocks are logical: a page per layer group, the sliding ones let go behind windows.

    A page is *needed* while its block is held and, in a sliding group, some
    holder's window still reads it. A page nobody needs is freed, unless its
    block caches a prefix: then it stays with the block as *reclaimable* (vLLM's
    cached free blocks), so a later prefix hit can still use it, until the pool
    takes it back, least recently let go first. A cached block that loses a
    full-layer page (or, with every layer sliding, its last page) leaves the
    prefix cache.

    ``num_blocks`` is the pool in whole blocks (every layer), as for the plain
    manager; it holds ``num_blocks * num_groups`` pages. ``num_free_blocks``
    counts free and reclaimable pages, in whole blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, layout: PageLayout,
                 enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.layout = layout
        groups = layout.num_groups
        self.num_pages = num_blocks * groups
        self._sliding_groups = [g for g in range(groups) if layout.sliding[g]]
        self._blocks: list[_LogicalBlock] = []  # type: ignore[assignment]
        self._free = OrderedDict()  # unused: pages are accounted below
        self._free_pages: list[int] = list(range(self.num_pages - 1, -1, -1))  # popped from the end: 0 first
        # Pages nobody needs whose block caches a prefix, least recently let go first: page -> (block, group).
        self._reclaimable: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._free_ids: list[int] = []
        # Logical block -> its page in each group (NO_PAGE: none); grows on demand.
        self.pages = np.full((max(16, num_blocks), groups), NO_PAGE, dtype=np.int64)
        # Per sequence: its leading blocks it no longer reads in the sliding layers (no window reference).
        self._released: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self._available_pages() // self.layout.num_groups

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_pages(self) -> int:
        """Pages no block has (not counting the reclaimable ones)."""
        return len(self._free_pages)

    @property
    def num_reclaimable_pages(self) -> int:
        return len(self._reclaimable)

    def num_pages_held(self, seq: Sequence) -> int:
        """Pages the blocks of ``seq`` hold that some holder needs (shared ones included; not reclaimable ones)."""
        return sum(
            1 for page in self.pages[seq.block_table].flatten().tolist()
            if page != NO_PAGE and page not in self._reclaimable
        )

    def free_block_ids(self) -> list[int]:
        """Blocks nobody holds that still cache a prefix, in the order their first pages are reclaimed."""
        return list(dict.fromkeys(block_id for block_id, _ in self._reclaimable.values()
                                  if self._blocks[block_id].ref_count == 0))

    def held_block_ids(self) -> list[int]:
        return [block.block_id for block in self._blocks if block.ref_count > 0]

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        if self.layout.num_sliding_groups < self.layout.num_groups:
            block_ids = self._usable(super().get_computed_blocks(seq)[0])
            return block_ids, len(block_ids) * self.block_size
        return self._window_hit(seq)

    def _window_hit(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest hit where every layer slides (vLLM's sliding-window lookup, from the end): only the
        blocks the next query's window reads must be cached with their pages; the ones before it are given as
        ``NO_PAGE`` (``allocate`` makes them blocks without pages, which nothing reads)."""
        if not self.enable_prefix_caching or seq.num_computed_tokens > 0:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        found = [self._cached.get(block_hash) for block_hash in seq.block_hashes()[:max_blocks]]
        # last_missing[i]: the last index before i whose block is not cached with its pages (-1: none).
        last_missing, missing = [-1], -1
        for index, block_id in enumerate(found):
            if block_id is None or not self._has_window_pages(block_id):
                missing = index
            last_missing.append(missing)
        for count in range(len(found), 0, -1):
            first = self.layout.first_needed_block(count * self.block_size, self.block_size)
            if last_missing[count] < first:
                return [NO_PAGE] * first + [int(b) for b in found[first:count]], count * self.block_size  # type: ignore[arg-type]
        return [], 0

    def _usable(self, block_ids: list[int], num_tokens: int | None = None) -> list[int]:
        """The longest prefix of cached ``block_ids`` whose blocks the sliding layers read still have their
        pages; the next query sits at ``num_tokens`` (an import's), or at the end of the prefix (None)."""
        count = len(block_ids)
        while count:
            end = count * self.block_size if num_tokens is None else num_tokens
            first = self.layout.first_needed_block(end, self.block_size)
            if all(self._has_window_pages(b) for b in block_ids[first:count]):
                break
            count -= 1
        return block_ids[:count]

    def _has_window_pages(self, block_id: int) -> bool:
        return bool((self.pages[block_id, self._sliding_groups] != NO_PAGE).all())

    # ---- admission and growth ---------------------------------------------------------

    def _available_pages(self) -> int:
        return len(self._free_pages) + len(self._reclaimable)

    def _reuse_cost(self, block_ids: Seq[int], first: int) -> int:
        """Reclaimable pages that taking ``block_ids`` as a prefix makes needed again (the sliding ones from
        block ``first`` on): they leave what the pool can take."""
        cost = 0
        for index, block_id in enumerate(block_ids):
            if block_id == NO_PAGE:  # a block without pages (``_window_hit``): nothing to take back
                continue
            for group in range(self.layout.num_groups):
                if self.layout.sliding[group] and index < first:
                    continue
                cost += int(self.pages[block_id, group]) in self._reclaimable
        return cost

    def _fits(self, num_new: int, reused: Seq[int] = (), first: int = 0, num_outside_window: int = 0) -> bool:
        """Whether ``num_new`` new blocks (the first ``num_outside_window`` of them without sliding pages) and
        the cached ``reused`` ones (read in the sliding layers from block ``first`` on) fit."""
        pages = num_new * self.layout.num_groups - num_outside_window * len(self._sliding_groups)
        return pages + self._reuse_cost(reused, first) <= self._available_pages()

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()) -> bool:
        num_computed = len(computed_blocks) * self.block_size
        needed = self._num_new_blocks(seq, num_computed, len(computed_blocks), num_new_tokens)
        return self._fits(needed, computed_blocks, self.layout.first_needed_block(num_computed, self.block_size))

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()) -> None:
        # A hit's leading blocks before its window (``NO_PAGE``, where every layer slides) become blocks without
        # pages, held by ``seq`` alone; never cached, as the base class counts a hit's blocks as cached already.
        leading = next((index for index, block_id in enumerate(computed_blocks) if block_id != NO_PAGE),
                       len(computed_blocks))
        if leading:
            if not self.can_allocate(seq, num_new_tokens, computed_blocks):
                raise RuntimeError(f"not enough free KV pages for sequence {seq.request_id}")
            computed_blocks = [self._take_pageless_block() for _ in range(leading)] + list(computed_blocks[leading:])
        super().allocate(seq, num_new_tokens, computed_blocks)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._fits(self._num_new_blocks(seq, seq.num_computed_tokens, len(seq.block_table), num_new_tokens))

    def can_reserve(self, num_blocks: int) -> bool:
        return self._fits(num_blocks)

    def _touch_prefix(self, seq: Sequence, block_ids: Seq[int], num_tokens: int) -> None:
        # Window references on the blocks the sliding layers read from ``num_tokens`` on, before any page is taken.
        first = self.layout.first_needed_block(num_tokens, self.block_size)
        for index, block_id in enumerate(block_ids):
            block = self._blocks[block_id]
            block.ref_count += 1
            block.window_refs += index >= first
            self._settle(block)
        # Blocks between the prefix and ``first`` (an import's) are taken without a window reference.
        self._released[seq.request_id] = first

    def allocate_imported(self, seq: Sequence, block_hashes: Seq[BlockHash], num_tokens: int) -> list[int]:
        reservation = seq.kv_reservation
        first_pushed = seq.num_blocks_for(num_tokens) if reservation is None else reservation.first_block
        to_fill = super().allocate_imported(seq, block_hashes, num_tokens)
        # Pushed blocks were written in every layer: the ones before the window give their sliding pages back.
        first = self.layout.first_needed_block(num_tokens, self.block_size)
        for block_id in seq.block_table[first_pushed:first]:
            self._drop_window_ref(self._blocks[block_id])
        return to_fill

    def _reusable(self, block_hashes: Seq[BlockHash], num_tokens: int) -> list[int]:
        return self._usable(self.lookup_prefix(block_hashes)[: num_tokens // self.block_size], num_tokens)

    def _take_import_block(self, index: int, num_tokens: int) -> int:
        """A block the sliding layers no longer read (before the window of ``num_tokens``) gets full-layer pages
        only, and no window reference; its import skips the sliding layers."""
        return self._take_free_block(sliding=index >= self.layout.first_needed_block(num_tokens, self.block_size))

    def can_import(self, seq: Sequence, block_hashes: Seq[BlockHash], num_tokens: int) -> bool:
        reused = self._reusable(block_hashes, num_tokens)
        reservation = seq.kv_reservation
        num_blocks = seq.num_blocks_for(num_tokens)
        first_pushed = num_blocks if reservation is None else reservation.first_block
        first = self.layout.first_needed_block(num_tokens, self.block_size)
        needed = max(0, first_pushed - len(reused))
        outside = max(0, min(first_pushed, first) - len(reused))
        return self._fits(needed, reused, first, outside)

    # ---- the window moving on ------------------------------------------------------------

    def trim(self, seq: Sequence) -> None:
        """Drop ``seq``'s window reference on the blocks its next query (at ``num_computed_tokens``) no longer
        reads in the sliding layers; a block nobody reads there lets its sliding pages go."""
        start = self._released.get(seq.request_id, 0)
        end = min(len(seq.block_table), self.layout.first_needed_block(seq.num_computed_tokens, self.block_size))
        for block_id in seq.block_table[start:end]:
            self._drop_window_ref(self._blocks[block_id])
        if end > start:
            self._released[seq.request_id] = end

    def _drop_window_ref(self, block: _LogicalBlock) -> None:
        block.window_refs -= 1
        self._settle(block)

    # ---- release -------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        start = self._released.pop(seq.request_id, 0)
        for block_id in seq.block_table[start:]:
            self._drop_window_ref(self._blocks[block_id])
        super().free(seq)

    def release_unused(self, seq: Sequence) -> None:
        keep = seq.num_blocks_for(seq.num_computed_tokens)
        start = self._released.get(seq.request_id, 0)
        while len(seq.block_table) > keep:
            index = len(seq.block_table) - 1
            block_id = seq.block_table.pop()
            if index >= start:
                self._blocks[block_id].window_refs -= 1
            self._release((block_id,))

    # ---- internals -----------------------------------------------------------------

    def _settle(self, block: _LogicalBlock) -> None:
        """Put each page of ``block`` where its state says: needed (with the block), reclaimable (nobody needs
        it, the block caches a prefix) or free; a block nobody holds with no page left is given up."""
        row = self.pages[block.block_id]
        for group in range(self.layout.num_groups):
            page = int(row[group])
            if page == NO_PAGE:
                continue
            needed = block.ref_count > 0 and (not self.layout.sliding[group] or block.window_refs > 0)
            if needed:
                self._reclaimable.pop(page, None)
            elif block.block_hash is not None:
                if page not in self._reclaimable:
                    self._reclaimable[page] = (block.block_id, group)
            else:
                self._reclaimable.pop(page, None)
                self._free_pages.append(page)
                row[group] = NO_PAGE
        if block.ref_count == 0 and (row == NO_PAGE).all():
            self._give_up(block)

    def _give_up(self, block: _LogicalBlock) -> None:
        """A block nobody holds leaves the prefix cache; its pages go free, its id is reused."""
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            self._events.append(BlockRemoved((block.block_hash,)))
            block.block_hash = None
        row = self.pages[block.block_id]
        for page in row[row != NO_PAGE].tolist():
            self._reclaimable.pop(page, None)
            self._free_pages.append(page)
        row[:] = NO_PAGE
        self._free_ids.append(block.block_id)

    def _release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                block.window_refs = 0
                self._settle(block)

    def _take_page(self) -> int:
        if not self._free_pages:
            page, (block_id, group) = self._reclaimable.popitem(last=False)
            block = self._blocks[block_id]
            self.pages[block_id, group] = NO_PAGE
            if not self.layout.sliding[group]:
                # Its full layers are incomplete now: nobody holds it (a held block's full pages are needed).
                self._give_up(block)
            elif block.ref_count == 0 and (self.pages[block_id] == NO_PAGE).all():
                self._give_up(block)
            return page
        return self._free_pages.pop()

    def _take_pageless_block(self) -> int:
        """A logical block with no page and no holder yet (``_touch_prefix`` takes it for its sequence)."""
        assert self.layout.num_sliding_groups == self.layout.num_groups, "only where every layer slides"
        block_id = self._take_free_block(sliding=False)  # every layer slides: no full-layer page either
        block = self._blocks[block_id]
        block.ref_count = block.window_refs = 0
        return block_id

    def _take_free_block(self, sliding: bool = True) -> int:
        """A block with ref count 1 and a page in every group (``sliding`` False: in the full groups only)."""
        if self._free_ids:
            block_id = self._free_ids.pop()
        else:
            block_id = len(self._blocks)
            self._blocks.append(_LogicalBlock(block_id))
            if block_id >= len(self.pages):
                grown = np.full((2 * len(self.pages), self.layout.num_groups), NO_PAGE, dtype=np.int64)
                grown[: len(self.pages)] = self.pages
                self.pages = grown
        for group in range(self.layout.num_groups):
            if sliding or not self.layout.sliding[group]:
                self.pages[block_id, group] = self._take_page()
        block = self._blocks[block_id]
        block.ref_count = 1
        block.window_refs = int(sliding)
        return block_id


class PageMirror:
    """Rank 0's page table rows, as another tensor-parallel rank knows them: the rows of the blocks each export
    or import names arrive with it (``update``); a step needs none (rank 0 sends it in pages). ``pages``
    reads as ``PagedBlockManager.pages`` does, for ``KVCache``."""

    def __init__(self, num_groups: int) -> None:
        self.pages = np.full((16, num_groups), NO_PAGE, dtype=np.int64)

    def update(self, block_ids: Seq[int], rows: np.ndarray) -> None:
        """Blocks ``block_ids`` have pages ``rows`` ((len(block_ids), groups)) now."""
        ids = np.asarray(list(block_ids), dtype=np.int64)
        if ids.size == 0:
            return
        needed = int(ids.max()) + 1
        if needed > len(self.pages):
            grown = np.full((max(needed, 2 * len(self.pages)), self.pages.shape[1]), NO_PAGE, dtype=np.int64)
            grown[: len(self.pages)] = self.pages
            self.pages = grown
        self.pages[ids] = rows
