"""Ownership of KV cache blocks: allocation, ref counts, prefix cache, eviction.

Every block is in exactly one of two states: held (ref count > 0, in some
sequence's block table) or free (ref count 0, in the free queue). A free block
may still carry a block hash: its KV is intact and a later request with the same
prefix takes it back out of the queue instead of recomputing it. The free queue
is ordered for eviction: blocks without a hash come first, then cached blocks
from least to most recently freed.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Sequence as Seq

from pdserve.engine.sequence import Sequence
from pdserve.engine.types.handoff import KVReservation
from pdserve.engine.types.hashing import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Full blocks whose KV is now cached under these hashes (publish to the index)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks that were evicted: their hashes no longer hit here."""

    block_hashes: tuple[BlockHash, ...]


BlockEvent = BlockStored | BlockRemoved


class _Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None


class BlockManager:
    """Hands out KV blocks to sequences; the caller asks ``can_*`` before each action."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        """``sliding_window``: the model's sliding layers' window, where this pool keeps every block in them
        (tensor parallelism, a draft model): imported KV before it may come from a paged pool that freed
        those layers (as zeros), so such blocks are not cached for other requests."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # How many leading blocks of each sequence are registered in the prefix cache.
        self._num_registered: dict[str, int] = {}
        self._events: list[BlockEvent] = []

    # ---- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next to be reused first)."""
        return list(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def held_block_ids(self) -> list[int]:
        """Blocks some sequence, lease or reservation holds (ref count above 0)."""
        return [block.block_id for block in self._blocks if block.ref_count > 0]

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds now (to rebuild an index from scratch)."""
        return list(self._cached)

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest cached prefix of ``seq``: block ids and the number of tokens they cover.

        At least one token is always left to compute, because the step that
        computes it produces the logits the next token is sampled from.
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens > 0:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in seq.block_hashes()[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def lookup_prefix(self, block_hashes: Seq[BlockHash]) -> list[int]:
        """Block ids of the longest prefix of ``block_hashes`` cached here."""
        block_ids: list[int] = []
        if self.enable_prefix_caching:
            for block_hash in block_hashes:
                block_id = self._cached.get(block_hash)
                if block_id is None:
                    break
                block_ids.append(block_id)
        return block_ids

    # ---- admission and growth ---------------------------------------------------------

    def _num_new_blocks(self, seq: Sequence, num_computed: int, num_held: int, num_new_tokens: int) -> int:
        return max(0, seq.num_blocks_for(num_computed + num_new_tokens) - num_held)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()) -> bool:
        """Whether ``seq`` (holding no blocks) fits: its cached prefix plus ``num_new_tokens``."""
        num_computed = len(computed_blocks) * self.block_size
        needed = self._num_new_blocks(seq, num_computed, len(computed_blocks), num_new_tokens)
        # Cached blocks sitting in the free queue leave it when they are taken.
        reused_from_free = sum(1 for b in computed_blocks if self._blocks[b].ref_count == 0)
        return needed + reused_from_free <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()) -> None:
        """Give ``seq`` its cached prefix blocks and enough new blocks for ``num_new_tokens``."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.request_id}")
        self._touch_prefix(seq, computed_blocks, len(computed_blocks) * self.block_size)
        seq.block_table = list(computed_blocks)
        seq.num_computed_tokens = len(computed_blocks) * self.block_size
        self._num_registered[seq.request_id] = len(computed_blocks)
        self._grow(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a running ``seq`` can compute ``num_new_tokens`` more tokens."""
        needed = self._num_new_blocks(seq, seq.num_computed_tokens, len(seq.block_table), num_new_tokens)
        return needed <= len(self._free)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.request_id}")
        self._grow(seq, num_new_tokens)

    def _grow(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self._num_new_blocks(seq, seq.num_computed_tokens, len(seq.block_table), num_new_tokens)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def allocate_imported(self, seq: Sequence, block_hashes: Seq[BlockHash], num_tokens: int) -> list[int]:
        """Blocks for ``num_tokens`` tokens whose KV arrives from another worker.

        Leading blocks already cached here (by hash) are reused, and the blocks of
        ``seq.kv_reservation`` (pushed KV, already written) are adopted where they
        follow those; reserved blocks the prefix cache made redundant are freed.
        Returns the indices, within the block table, of the blocks whose data must
        still be copied in: from the first block neither cached nor pushed to the
        end (pushed blocks after a gap are written again), none when the push
        covers the rest. The caller must have checked ``can_import``.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        reservation, seq.kv_reservation = seq.kv_reservation, None
        num_blocks = seq.num_blocks_for(num_tokens)
        reused = self._reusable(block_hashes, num_tokens)
        first_pushed = num_blocks if reservation is None else reservation.first_block
        if reservation is not None and reservation.end_block != num_blocks:
            raise RuntimeError(f"the reservation of {seq.request_id} ends at block {reservation.end_block}, "
                               f"not at its last block {num_blocks}")
        self._touch_prefix(seq, reused, num_tokens)
        seq.block_table = list(reused)
        self._num_registered[seq.request_id] = len(reused)
        if self.sliding_window is not None and num_tokens - self.sliding_window + 1 > len(reused) * self.block_size:
            # Imported blocks the window has passed may hold zeros in the sliding layers: never cached.
            self._num_registered[seq.request_id] = sys.maxsize
        for index in range(len(reused), num_blocks):
            if index >= first_pushed:
                # Held with ref count 1 since ``reserve``: the sequence takes that reference over.
                seq.block_table.append(reservation.block_ids[index - first_pushed])
            else:
                seq.block_table.append(self._take_import_block(index, num_tokens))
        if reservation is not None:
            self._release(reservation.block_ids[: max(0, len(reused) - first_pushed)])
        seq.num_computed_tokens = num_tokens
        if first_pushed > len(reused):
            return list(range(len(reused), num_blocks))
        return []

    def _reusable(self, block_hashes: Seq[BlockHash], num_tokens: int) -> list[int]:
        """The blocks cached here that an import of ``num_tokens`` tokens with these hashes reuses."""
        return self.lookup_prefix(block_hashes)[: num_tokens // self.block_size]

    def _take_import_block(self, index: int, num_tokens: int) -> int:
        """A block for position ``index`` of an import of ``num_tokens`` tokens."""
        return self._take_free_block()

    def can_import(self, seq: Sequence, block_hashes: Seq[BlockHash], num_tokens: int) -> bool:
        reused = self._reusable(block_hashes, num_tokens)
        reservation = seq.kv_reservation
        num_blocks = seq.num_blocks_for(num_tokens)
        first_pushed = num_blocks if reservation is None else reservation.first_block
        needed = max(0, first_pushed - len(reused))
        reused_from_free = sum(1 for b in reused if self._blocks[b].ref_count == 0)
        return needed + reused_from_free <= len(self._free)

    # ---- blocks for KV that arrives before its sequence -------------------------------

    def can_reserve(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def reserve(self, num_blocks: int) -> list[int]:
        """``num_blocks`` blocks held for pushed KV (ref count 1, in no block table) until a sequence
        adopts them (``allocate_imported``) or ``free_reserved`` gives them back."""
        if not self.can_reserve(num_blocks):
            raise RuntimeError(f"not enough free KV blocks to reserve {num_blocks}")
        return [self._take_free_block() for _ in range(num_blocks)]

    def free_reserved(self, reservation: KVReservation) -> None:
        """Give back reserved blocks nobody adopted; they hold nothing cached."""
        self._release(reservation.block_ids)

    # ---- prefix cache --------------------------------------------------------------

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full of computed KV."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_registered.get(seq.request_id, 0)
        if num_full <= start:
            return
        hashes = seq.block_hashes()
        stored: list[BlockHash] = []
        for i in range(start, num_full):
            block = self._blocks[seq.block_table[i]]
            block_hash = hashes[i]
            # A block computed twice (two requests with the same prefix admitted
            # together) stays uncached: the index keeps the first copy.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
                stored.append(block_hash)
        self._num_registered[seq.request_id] = num_full
        if stored:
            self._events.append(BlockStored(tuple(stored)))

    def drain_events(self) -> list[BlockEvent]:
        """Stored/removed events since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    # ---- release -------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; cached ones stay reusable until evicted."""
        # Tail blocks first, so a sequence's later blocks are evicted before the
        # prefix blocks that other requests are more likely to share.
        self._release(reversed(seq.block_table))
        if seq.kv_reservation is not None:
            # Ended before it was allocated: its pushed KV is of no use.
            self._release(seq.kv_reservation.block_ids)
            seq.kv_reservation = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_draft_computed_tokens = 0
        seq.draft_proposal = None
        self._num_registered.pop(seq.request_id, None)

    def trim(self, seq: Sequence) -> None:
        """Free what ``seq``'s next query no longer reads (nothing here: every layer reads the whole context;
        ``engine.kv.pages.PagedBlockManager`` frees what sliding windows left behind)."""

    def release_unused(self, seq: Sequence) -> None:
        """Free the blocks past the ones ``seq.num_computed_tokens`` needs (rejected speculative positions).

        Those blocks were taken for this step's proposal and hold nothing cached:
        they go back to the front of the free queue, as if never taken.
        """
        keep = seq.num_blocks_for(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)

    # ---- internals -----------------------------------------------------------------

    def _release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds goes back to the free queue
        (to its front when it caches nothing: reused before any cached block)."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def _touch_prefix(self, seq: Sequence, block_ids: Seq[int], num_tokens: int) -> None:
        """``seq`` takes these cached blocks as its prefix, its next query at position ``num_tokens``."""
        for block_id in block_ids:
            self._touch(block_id)

    def _touch(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            self._events.append(BlockRemoved((block.block_hash,)))
            block.block_hash = None
        block.ref_count = 1
        return block_id
