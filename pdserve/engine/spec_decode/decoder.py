"""Speculative decoding around the engine's step: who proposes, how a verified run is kept.

Verification is sampling: the target samples every verified position exactly as
plain decoding would (same logits processors, temperature, top-k/top-p, the same
exponential-race draw from the request's generator), and a proposed token is
kept while it equals the target's sample at its position; the first position
whose sample differs contributes that sample instead, and a fully accepted run
adds the sample after it. For a deterministic proposal (both proposers here
propose greedily) this is rejection sampling with a one-hot draft distribution
q: the proposed token d is accepted with probability p(d) = min(1, p(d)/q(d)),
and on rejection the token is drawn from p restricted to tokens other than d,
renormalised, which is the residual max(p - q, 0) normalised. Every emitted
token therefore follows the target's distribution exactly.

Randomness: a seeded request draws one noise vector per sampled position from
its own generator, in position order. Positions past the first rejection are
discarded, and the generator is rewound to just after the draws that were kept,
so a seeded request consumes one draw per output token, like plain decoding:
its tokens are the same with or without speculation, whatever the batch and
whatever was accepted. Greedy requests draw nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode.adaptive import AdaptivePolicy
from pdserve.engine.spec_decode.proposer import NgramProposer, Proposer
from pdserve.engine.types.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from pdserve.engine.spec_decode.draft_model import DraftModelProposer, DraftTarget


class SpecDecoder:
    """Proposes for the running batch after every step, and keeps the accepted part of each verified run."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        max_model_len: int,
        vocab_size: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.clock = clock
        # None: every request proposes its full limit whenever it may (config.adaptive off).
        self.policy = AdaptivePolicy(config.method) if config.adaptive else None
        # Seconds the last propose() took: part of the cost of the step that verifies its proposals
        # (None: it also did one-off work, so that step's time is not a sample of the cost).
        self._propose_seconds: float | None = 0.0
        # Engine-wide counters (Prometheus' pdserve_spec_decode_*).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ---- before the step: proposals ----------------------------------------------------

    def is_active(self, scheduler: Scheduler) -> bool:
        """Whether the engine speculates now: not while more requests are in it than the cut-off."""
        return len(scheduler.running) + scheduler.num_waiting <= self.config.disable_by_batch_size

    def step_started(self) -> float:
        """The clock at the start of a step (what ``observe_step`` measures from)."""
        return self.clock()

    def observe_step(self, output: SchedulerOutput, started: float) -> None:
        """Tell the policy what the step that began at ``started`` cost (with the proposing before it)."""
        if self.policy is None:
            return
        propose_seconds, self._propose_seconds = self._propose_seconds, 0.0
        decode_only = all(
            item.num_new_tokens == 1 + len(item.spec_token_ids) and item.samples for item in output.scheduled
        )
        seconds = None
        if decode_only and propose_seconds is not None:
            seconds = self.clock() - started + propose_seconds
        num_proposed = sum(len(item.spec_token_ids) for item in output.scheduled)
        self.policy.observe_step(len(output.scheduled), num_proposed, seconds)

    def propose(self, scheduler: Scheduler) -> None:
        """Give every running, decoding sequence that may speculate a proposal for the next step."""
        if not self.is_active(scheduler):
            return
        started = self.clock()
        seqs, limits = [], []
        for seq in scheduler.running:
            limit = self._max_proposal(seq)
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if seqs and self.policy is not None:
            wanted = self.policy.limits(seqs, limits, len(scheduler.running))
            seqs, limits = [s for s, k in zip(seqs, wanted) if k > 0], [k for k in wanted if k > 0]
        one_off = bool(seqs) and self.proposer.catches_up(seqs, limits)
        if seqs:
            for seq, proposal in zip(seqs, self.proposer.propose(seqs, limits)):
                seq.spec_token_ids = list(proposal)
        self._propose_seconds = None if one_off else self.clock() - started

    def _max_proposal(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may verify next step: none unless it only has its last token to
        compute; never past max_tokens (the run adds one token after the accepted ones) or max_model_len."""
        if (
            not seq.params.use_speculation
            or seq.status is not SequenceStatus.RUNNING
            or seq.num_computed_tokens != seq.num_tokens - 1
        ):
            return 0
        remaining = seq.params.max_tokens - seq.num_output_tokens - 1
        room = self.max_model_len - seq.num_tokens
        return min(self.config.num_speculative_tokens, remaining, room)

    def save_generators(self, output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """States of the generators that this step's verification may have to rewind."""
        return {
            item.seq.request_id: item.seq.generator.get_state()
            for item in output.scheduled
            if item.spec_token_ids and item.samples and item.seq.generator is not None and not item.seq.params.is_greedy
        }

    # ---- after the step: keep the accepted run --------------------------------------------

    @staticmethod
    def num_accepted(samples: list[int], proposal: Iterable[int]) -> int:
        """Leading proposed tokens equal to the target's sample at their position."""
        count = 0
        for sample, proposed in zip(samples, proposal):
            if sample != proposed:
                break
            count += 1
        return count

    def record(
        self, seq: Sequence, num_proposed: int, num_accepted: int, generator_states: Mapping[str, torch.Tensor]
    ) -> None:
        """Count one verified proposal, and rewind a seeded generator past the discarded positions' draws."""
        seq.num_spec_steps += 1
        seq.num_draft_tokens += num_proposed
        seq.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if self.policy is not None:
            self.policy.observe_verified(seq, num_proposed, num_accepted)
        state = generator_states.get(seq.request_id)
        if state is not None and num_accepted < num_proposed:
            generator = seq.generator
            assert generator is not None
            generator.set_state(state)
            # The same draws the sampler made for the kept positions (Sampler._exponential_noise).
            for _ in range(num_accepted + 1):
                torch.empty(self.vocab_size, dtype=torch.float32, device=generator.device).exponential_(
                    generator=generator
                )


def load_draft(config: SpeculativeConfig, target: DraftTarget) -> DraftModelProposer | None:
    """The draft model of a ``draft_model`` config, loaded and checked against the target engine's model
    (whose pool is not sized yet: the draft's per-block bytes count in its sizing); None for other methods."""
    if config.method != "draft_model":
        return None
    from pdserve.engine.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, target)


def build_spec_decoder(
    config: SpeculativeConfig, draft: DraftModelProposer | None, num_blocks: int, max_model_len: int, vocab_size: int
) -> SpecDecoder:
    """The decoder for an engine whose pool of ``num_blocks`` blocks now exists (``draft``: from ``load_draft``)."""
    if draft is None:
        proposer: Proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        draft.allocate_kv(num_blocks)
        proposer = draft
    return SpecDecoder(config, proposer, max_model_len, vocab_size)
