"""When speculating pays, per request: how many tokens it proposes, from its recent acceptance and the measured cost.

Speculation is a bet: a step that verifies ``k`` proposed tokens costs more than
a plain step (the extra query rows, and for a draft model its ``k`` forwards),
and pays only with what gets accepted. With per-token acceptance ``a`` (each
proposed token kept, given the ones before it were, with probability ``a``) a
step that proposes ``k`` yields ``1 + a + ... + a**k`` tokens on average, for a
cost of ``1 + k * r`` plain steps, ``r`` being the measured extra cost of one
proposed token relative to a plain step. Each request proposes the ``k`` (at most
its configured limit) that maximises tokens per unit of cost; when that is 0 —
its recent acceptance is below the cost of one proposed token — it stops
proposing and probes again (at least one token, from the prior) after a
back-off that doubles while probes keep failing. Which tokens a request
produces never depends on any of this (the verifier keeps only what the target
would have chosen), only how fast.

``a`` is estimated per request from its recent verified proposals (counts decay
geometrically, so old behaviour fades), starting from the engine's recent
acceptance over all requests; ``r`` engine-wide from step wall times: plain
steps (nothing proposed) give the plain cost per number of sequences in the
step, steps that verified proposals the extra per proposed token. The
decoder (decoder.py) times the steps with its clock, which tests replace to
decide with exact, fake costs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from engine.sequence import Sequence

# Per-request acceptance: each verified proposal first multiplies the request's
# counts by DECAY, so its estimate follows its last few proposals. It starts (and
# restarts after sitting out) from the engine's recent acceptance over every
# request (decaying slower), worth PRIOR_WEIGHT tokens: in a workload of copying
# requests a new one proposes long runs at once, in a chat workload short ones.
DECAY = 0.8
POPULATION_DECAY = 0.95
PRIOR_WEIGHT = 2.0
# Steps a request sits out after its estimate says stop; doubled per failed probe, up to the maximum.
FIRST_BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 64
# The cost of a proposed token before any is measured (relative to a plain step), per method:
# n-gram's is only the extra rows of the verify forward; a draft model adds its own forward per token.
# It counts as PRIOR_COST_TOKENS tokens' worth of measurement.
PRIOR_TOKEN_COST = {"ngram": 0.05, "draft_model": 0.4}
PRIOR_COST_TOKENS = 8.0
# A step's extra cost per proposed token is clamped to this (a draft forward as dear as two target
# steps): one step stalled by another process must not switch speculation off for long.
MAX_TOKEN_COST_SAMPLE = 2.0
# Decay of the cost sums per speculating step, and weight of a new sample in the plain step's average.
COST_DECAY = 0.9
PLAIN_SMOOTHING = 0.2
# With a draft model every step may propose: force a plain step this often to re-measure its cost.
RECALIBRATE_EVERY = 64


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step yields on average when it verifies ``k`` proposed tokens: 1 + a + ... + a**k."""
    return sum(acceptance**i for i in range(k + 1))


def best_num_tokens(acceptance: float, token_cost: float, max_k: int) -> int:
    """The proposal length in 0..max_k with the most tokens per unit of step cost (ties: the shorter)."""
    best_k, best_rate = 0, 1.0
    for k in range(1, max_k + 1):
        rate = expected_tokens(acceptance, k) / (1.0 + k * token_cost)
        if rate > best_rate + 1e-12:
            best_k, best_rate = k, rate
    return best_k


@dataclass
class RequestAcceptance:
    """Recent acceptance (decayed counts of accepted tokens and rejections) and, for a request, its back-off."""

    accepted: float = 1.0
    rejected: float = 1.0
    resume_at_step: int = 0
    backoff_steps: int = FIRST_BACKOFF_STEPS
    # Whether its next proposal is a probe (at least one token whatever the estimates say).
    probe_next: bool = True

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def restart_from(self, acceptance: float) -> None:
        self.accepted, self.rejected = PRIOR_WEIGHT * acceptance, PRIOR_WEIGHT * (1.0 - acceptance)

    def observe(self, num_proposed: int, num_accepted: int, decay: float = DECAY) -> None:
        # A run of accepted tokens then (unless all were kept) one rejection: the
        # truncated-geometric likelihood's counts.
        self.accepted = self.accepted * decay + num_accepted
        self.rejected = self.rejected * decay + (1 if num_accepted < num_proposed else 0)


class StepCosts:
    """What steps cost: a plain step per number of sequences (running average), and a proposed token's
    extra relative to it (decayed sums of extra cost over proposed tokens, so long proposals weigh more)."""

    def __init__(self, prior_token_cost: float) -> None:
        self.plain_seconds: dict[int, float] = {}
        self.steps_since_plain: dict[int, int] = {}
        self._extra = prior_token_cost * PRIOR_COST_TOKENS  # in plain steps
        self._tokens = PRIOR_COST_TOKENS

    @property
    def token_cost(self) -> float:
        """The extra cost of one proposed token, in plain steps."""
        return max(0.0, self._extra / self._tokens)

    def observe(self, num_seqs: int, num_proposed: int, seconds: float) -> None:
        plain = self.plain_seconds.get(num_seqs)
        if num_proposed == 0:
            self.plain_seconds[num_seqs] = (
                seconds if plain is None else (1.0 - PLAIN_SMOOTHING) * plain + PLAIN_SMOOTHING * seconds
            )
            self.steps_since_plain[num_seqs] = 0
            return
        self.steps_since_plain[num_seqs] = self.steps_since_plain.get(num_seqs, 0) + 1
        if plain is not None and plain > 0:
            extra = min(MAX_TOKEN_COST_SAMPLE * num_proposed, max(-1.0, seconds / plain - 1.0))
            self._extra = COST_DECAY * self._extra + extra
            self._tokens = COST_DECAY * self._tokens + num_proposed

    def needs_plain_step(self, num_seqs: int) -> bool:
        """Whether the plain cost at this batch size is unknown or stale (then nobody proposes this step)."""
        return num_seqs not in self.plain_seconds or self.steps_since_plain.get(num_seqs, 0) >= RECALIBRATE_EVERY


class AdaptivePolicy:
    """Per request proposal lengths from recent acceptance and measured costs (see the module docstring)."""

    def __init__(self, method: str) -> None:
        self.costs = StepCosts(PRIOR_TOKEN_COST[method])
        # Every request's verified proposals, the prior of new ones.
        self.population = RequestAcceptance()
        self.num_steps = 0
        # Lives as long as the request's Sequence: nothing to clean up when it finishes.
        self._requests: weakref.WeakKeyDictionary[Sequence, RequestAcceptance] = weakref.WeakKeyDictionary()

    def acceptance_of(self, seq: Sequence) -> RequestAcceptance:
        state = self._requests.get(seq)
        if state is None:
            state = self._requests[seq] = RequestAcceptance()
            state.restart_from(self.population.acceptance)
        return state

    def limits(self, seqs: list[Sequence], max_tokens: list[int], num_seqs: int) -> list[int]:
        """How many tokens each sequence proposes next step (at most ``max_tokens[i]``; 0: it sits out);
        ``num_seqs``: how many sequences the next step decodes."""
        if self.costs.needs_plain_step(num_seqs):
            return [0] * len(seqs)
        return [self._limit(seq, k) for seq, k in zip(seqs, max_tokens)]

    def _limit(self, seq: Sequence, max_k: int) -> int:
        state = self.acceptance_of(seq)
        if self.num_steps < state.resume_at_step:
            return 0
        k = best_num_tokens(state.acceptance, self.costs.token_cost, max_k)
        if state.probe_next:
            # A new request, or one back from sitting out: it proposes at least one token whatever
            # the estimates say, so that its acceptance and the cost of a token are measured anew
            # (a cost inflated by a noisy step would otherwise never come down).
            state.probe_next = False
            return max(1, k)
        if k > 0:
            return k
        state.resume_at_step = self.num_steps + state.backoff_steps
        state.backoff_steps = min(2 * state.backoff_steps, MAX_BACKOFF_STEPS)
        state.probe_next = True
        # Back from sitting out, it starts from the prior again: its old acceptance is stale.
        state.restart_from(self.population.acceptance)
        return 0

    def observe_verified(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        state = self.acceptance_of(seq)
        state.observe(num_proposed, num_accepted)
        self.population.observe(num_proposed, num_accepted, POPULATION_DECAY)
        if num_accepted > 0:
            state.backoff_steps = FIRST_BACKOFF_STEPS

    def observe_step(self, num_seqs: int, num_proposed: int, seconds: float | None) -> None:
        """One step of ``num_seqs`` sequences that verified ``num_proposed`` tokens in all; ``seconds`` its wall
        time (with its proposing), None when it also computed prompt tokens and so says nothing about decoding."""
        self.num_steps += 1
        if seconds is not None:
            self.costs.observe(num_seqs, num_proposed, seconds)

