"""Continuous batching: which tokens of which sequences run in the next step.

Every step mixes the decode tokens of running sequences with (chunked) prefill
tokens of waiting ones, under a token budget and a sequence limit. Running
sequences go first, oldest first, so admitted work always progresses; when the
pool runs dry the newest running sequence is preempted (its blocks freed, its
tokens recomputed later). A sequence's "tokens to compute" is simply
``num_tokens - num_computed_tokens``, which covers prompt chunks, decodes and
recomputation after preemption with one rule.

A request prefilled elsewhere enters as WAITING_FOR_REMOTE_KVS (vLLM v1): it
queues with the others for blocks, holds them in ``receiving`` while its KV is
on its way (never scheduled), and joins the running batch when the KV lands.
An abort ends it through ``finish`` like any other request.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.types.config import SchedulerConfig
from pdserve.engine.types.handoff import KVSlot


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: ``num_new_tokens`` tokens from ``start``.

    With a proposal, the last ``len(spec_token_ids)`` of those tokens are the
    proposed ones (vLLM v1's shape: speculative tokens are scheduled tokens);
    the step then samples at every position from the sequence's last token on.
    """

    seq: Sequence
    start: int  # num_computed_tokens when scheduled
    num_new_tokens: int
    # Whether this step reaches the sequence's last token, so a new token is sampled.
    samples: bool
    spec_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, seq: Sequence, start: int, num_new_tokens: int, spec_token_ids: tuple[int, ...] = ()
    ) -> ScheduledSequence:
        samples = start + num_new_tokens == seq.num_tokens + len(spec_token_ids)
        return cls(seq, start, num_new_tokens, samples, spec_token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """Positions whose logits this step samples: 1 + proposal length when sampling, else 0."""
        return 1 + len(self.spec_token_ids) if self.samples else 0

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start > 0


@dataclass(frozen=True)
class SchedulerOutput:
    """The decision of one step, handed to the model runner as one object."""

    scheduled: tuple[ScheduledSequence, ...]
    preempted: tuple[str, ...]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and the running batch; asks the block manager before every allocation."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # WAITING_FOR_REMOTE_KVS with blocks allocated, by request id: not scheduled until the KV lands.
        self.receiving: dict[str, Sequence] = {}
        # Allocations for remote KV since the last drain: where each request's KV must be written.
        self._new_slots: list[KVSlot] = []
        self.num_preemptions = 0
        # Called with every sequence this scheduler finishes (the engine releases its LoRA slot there).
        self.on_finish: Callable[[Sequence], None] | None = None

    # ---- requests in and out -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_remote(self, seq: Sequence) -> None:
        """Queue a sequence whose prompt KV comes from another engine; blocks now if it is first in line and fits."""
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.waiting.append(seq)
        if all(queued.is_finished for queued in itertools.islice(self.waiting, len(self.waiting) - 1)):
            # Nothing ahead of it: allocate at once, so the transfer starts before the next step.
            self._allocate_waiting_remote()

    def kv_received(self, seq: Sequence) -> None:
        """The KV of a ``receiving`` sequence landed in its blocks: it joins the running batch."""
        del self.receiving[seq.request_id]
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def kv_lost(self, seq: Sequence) -> None:
        """The KV of a ``receiving`` sequence will never land: recompute it here, first in line (as preempted)."""
        del self.receiving[seq.request_id]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def drain_kv_slots(self) -> list[KVSlot]:
        """Blocks allocated for remote KV since the last call, oldest first."""
        slots, self._new_slots = self._new_slots, []
        return slots

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        """End ``seq`` now (stop, length or abort); its blocks are freed at once unless the caller holds them."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.receiving.pop(seq.request_id, None)
        # A waiting sequence stays in the deque and is skipped lazily: removal
        # from the middle of a deque is O(n), skipping is O(1).
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if free_blocks:
            self.block_manager.free(seq)
        if self.on_finish is not None:
            self.on_finish(seq)

    @property
    def num_waiting(self) -> int:
        return sum(1 for seq in self.waiting if not seq.is_finished)

    @property
    def num_queued_tokens(self) -> int:
        """Tokens admitted or queued but not computed yet: the prefill work ahead."""
        pending = itertools.chain(self.running, (seq for seq in self.waiting if not seq.is_finished))
        return sum(seq.num_tokens - seq.num_computed_tokens for seq in pending)

    def next_step_has_room_for_prompts(self) -> bool:
        """Whether prompts wait to be computed here (not merely remote KV) and what runs and waits leaves room
        in the next step's token budget and sequence limit: a prompt arriving now would compute in it too."""
        if not any(seq.status is SequenceStatus.WAITING for seq in self.waiting):
            return False
        num_seqs = len(self.running) + self.num_waiting
        return self.num_queued_tokens < self.config.max_num_batched_tokens and num_seqs < self.config.max_num_seqs

    def has_work(self) -> bool:
        """Whether a step may do anything: a request runs or waits to be admitted (not merely for remote KV)."""
        return bool(self.running) or any(not seq.is_finished for seq in self.waiting)

    # ---- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            spec = self._fit_proposal(seq, num_new, budget)
            num_new += len(spec)
            while not self.block_manager.can_append(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                start = seq.num_computed_tokens
                self.block_manager.append(seq, num_new)
                scheduled.append(ScheduledSequence.of(seq, start, num_new, spec))
                budget -= num_new
                index += 1
                continue
            break

        # Admitting while preempting would only thrash the pool.
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        return SchedulerOutput(
            tuple(scheduled), tuple(preempted), self.config.max_num_batched_tokens - budget
        )

    def _fit_proposal(self, seq: Sequence, num_new: int, budget: int) -> tuple[int, ...]:
        """The part of ``seq``'s proposal that this step verifies (consumed: the sequence proposes anew).

        Only a sequence whose last token is all that is left to compute verifies;
        the proposal is cut to the token budget, and dropped when the blocks for
        it are not free: a proposal never preempts anybody.
        """
        spec, seq.spec_token_ids = seq.spec_token_ids, []
        if not spec or num_new != seq.num_tokens - seq.num_computed_tokens or num_new != 1:
            return ()
        spec = spec[: budget - num_new]
        if spec and not self.block_manager.can_append(seq, num_new + len(spec)):
            return ()
        return tuple(spec)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSequence]) -> int:
        while self.waiting and budget > 0 and self._num_admitted < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.is_finished:
                self.waiting.popleft()
                continue
            if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
                if not self._allocate_waiting_remote():
                    break
                continue
            if seq.needs_prompt_logprobs:
                # Cached KV has no logits: such a prompt is computed in full (as vLLM does).
                computed_blocks, num_cached = [], 0
            else:
                computed_blocks, num_cached = self.block_manager.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - num_cached, budget)
            # First come, first served: a request that does not fit blocks the ones
            # behind it, so long prompts are not starved by a stream of short ones.
            if not self.block_manager.can_allocate(seq, num_new, computed_blocks):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_new, computed_blocks)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence.of(seq, num_cached, num_new))
            budget -= num_new
        return budget

    @property
    def _num_admitted(self) -> int:
        return len(self.running) + len(self.receiving)

    def _allocate_waiting_remote(self) -> bool:
        """Give blocks to the remote sequences first in line; False when the first of them cannot have them yet."""
        while self.waiting:
            seq = self.waiting[0]
            if seq.is_finished:
                self.waiting.popleft()
                continue
            if seq.status is not SequenceStatus.WAITING_FOR_REMOTE_KVS:
                return True
            # The handoff's hashes, seeded into the sequence: only full prompt blocks can be reused.
            hashes, num_tokens = seq.block_hashes(), seq.num_prompt_tokens
            if self._num_admitted >= self.config.max_num_seqs or not self.block_manager.can_import(
                seq, hashes, num_tokens
            ):
                return False
            self.waiting.popleft()
            to_fill = self.block_manager.allocate_imported(seq, hashes, num_tokens)
            self.receiving[seq.request_id] = seq
            self._new_slots.append(KVSlot(seq.request_id, to_fill[0] if to_fill else len(seq.block_table)))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def complete_step(self, output: SchedulerOutput) -> None:
        """Record that the step ran: advance computed counts and cache newly full blocks.

        Proposed tokens are not counted as computed here: until verified they are
        not the sequence's tokens. ``accept_proposed`` adds the accepted ones.
        """
        for item in output.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens - len(item.spec_token_ids)
            self.block_manager.cache_computed_blocks(item.seq)
            # Sliding layers: what the window has left behind goes back to the pool (engine.kv.pages).
            self.block_manager.trim(item.seq)

    def accept_proposed(self, seq: Sequence, num_accepted: int) -> None:
        """After verification appended ``seq``'s accepted tokens: their KV counts as computed, the
        blocks held for the rejected positions go back to the pool, and newly full blocks are cached."""
        seq.num_computed_tokens += num_accepted
        self.block_manager.release_unused(seq)
        self.block_manager.cache_computed_blocks(seq)
        self.block_manager.trim(seq)
