"""When speculating pays, per request: how many tokens it proposes, from its recent acceptance and the measured cost.

Speculation is a bet: a step that verifies ``k`` proposed tokens costs more than
a plain step (the extra query rows, and for a draft model its ``k`` forwards),
and pays only with what gets accepted. With ``f`` the chance that a proposal's
first token is kept and ``a`` the chance that each further one is, given the one
before, a step that proposes ``k`` yields ``1 + f * (1 + a + ... + a**(k-1))``
tokens on average, for a cost of ``1 + x(k)`` plain steps, ``x(k)`` being the
measured extra cost of verifying ``k`` proposed tokens. Each request proposes the
``k`` (at most its configured limit) that maximises tokens per unit of cost; when
that is 0 — its recent acceptance does not pay for even the cheapest proposal —
it stops proposing and probes again (at least two tokens, from the prior) after
a back-off that doubles while probes keep failing. Which tokens a request
produces never depends on any of this (the verifier keeps only what the target
would have chosen), only how fast.

``f`` and ``a`` are estimated per request from its recent verified proposals (counts decay
geometrically, so old behaviour fades), starting from the engine's recent
acceptance over all requests; ``x`` engine-wide from step wall times: plain
steps (nothing proposed) give the plain cost per number of sequences in the
step, steps that verified proposals the extra per number of proposed tokens.
The decoder (decoder.py) times the steps with its clock, which tests replace to
decide with exact, fake costs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence

# Per-request acceptance: each verified proposal first multiplies the request's
# counts by DECAY, so its estimate follows its last few proposals. It starts (and
# restarts after sitting out) from the engine's recent acceptance over every
# request (decaying slower), worth PRIOR_WEIGHT tokens: in a workload of copying
# requests a new one proposes long runs at once, in a chat workload short ones.
DECAY = 0.8
POPULATION_DECAY = 0.95
PRIOR_WEIGHT = 2.0
# Tokens a probe proposes at least (a new request, or one back from sitting out).
PROBE_TOKENS = 2
# Steps a request sits out after its estimate says stop; doubled per failed probe, up to the maximum.
FIRST_BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 64
# The cost of a proposed token before any is measured (relative to a plain step), per method:
# n-gram's is only the extra rows of the verify forward; a draft model adds its own forward per token.
PRIOR_TOKEN_COST = {"ngram": 0.05, "draft_model": 0.4}
# A step's extra cost per proposed token is clamped to this (a draft forward as dear as two target
# steps): one step stalled by another process must not switch speculation off for long.
MAX_TOKEN_COST_SAMPLE = 2.0
# Weight of a new sample in the running averages of costs.
COST_SMOOTHING = 0.2
# With a draft model every step may propose: force a plain step this often to re-measure its cost.
RECALIBRATE_EVERY = 64


def expected_tokens(first: float, rest: float, k: int) -> float:
    """Tokens a step yields on average when it verifies ``k`` proposed tokens: the target's own, plus the
    first proposed one with probability ``first`` and each further one, given the one before, ``rest``."""
    return 1.0 + first * sum(rest**i for i in range(k))


def best_num_tokens(first: float, rest: float, extra_cost: Callable[[int], float], max_k: int) -> int:
    """The proposal length in 0..max_k with the most tokens per unit of step cost (ties: the shorter);
    ``extra_cost(k)``: what verifying k proposed tokens adds to a plain step, in plain steps."""
    best_k, best_rate = 0, 1.0
    for k in range(1, max_k + 1):
        rate = expected_tokens(first, rest, k) / (1.0 + extra_cost(k))
        if rate > best_rate + 1e-12:
            best_k, best_rate = k, rate
    return best_k


@dataclass
class RequestAcceptance:
    """Recent acceptance as decayed counts and, for a request, its back-off.

    Two rates, because a proposal's first token and the ones after it behave
    differently: n-gram lookup either lands on a passage being copied (then the
    whole run tends to be right) or on a chance match (then its first token is
    already wrong); one rate for both would shorten every proposal of a copying
    request after one chance miss. ``first``: proposals whose first token was
    kept, against those whose was not; ``rest``: tokens kept after a kept first
    one, against rejections after a kept first one.
    """

    first_hits: float = 1.0
    first_misses: float = 1.0
    rest_hits: float = 1.0
    rest_misses: float = 1.0
    resume_at_step: int = 0
    backoff_steps: int = FIRST_BACKOFF_STEPS
    # Whether its next proposal is a probe (at least one token whatever the estimates say).
    probe_next: bool = True

    @property
    def first(self) -> float:
        return self.first_hits / (self.first_hits + self.first_misses)

    @property
    def rest(self) -> float:
        return self.rest_hits / (self.rest_hits + self.rest_misses)

    def restart_from(self, prior: RequestAcceptance) -> None:
        first, rest = prior.first, prior.rest
        self.first_hits, self.first_misses = PRIOR_WEIGHT * first, PRIOR_WEIGHT * (1.0 - first)
        self.rest_hits, self.rest_misses = PRIOR_WEIGHT * rest, PRIOR_WEIGHT * (1.0 - rest)

    def observe(self, num_proposed: int, num_accepted: int, decay: float = DECAY) -> None:
        hit = num_accepted > 0
        self.first_hits = self.first_hits * decay + hit
        self.first_misses = self.first_misses * decay + (not hit)
        if hit and num_proposed > 1:
            # A run of kept tokens after the first, then (unless all were kept) one rejection:
            # the truncated-geometric likelihood's counts.
            self.rest_hits = self.rest_hits * decay + (num_accepted - 1)
            self.rest_misses = self.rest_misses * decay + (num_accepted < num_proposed)


class StepCosts:
    """What steps cost: a plain step per number of sequences, and the extra of a step that verifies ``n``
    proposed tokens in all, relative to it, per ``n`` (running averages).

    Per ``n``, not per token: the extra is far from proportional. At one thread the
    float32 default model's projections cost 1.5x at 2 rows what they cost at 1,
    2.2x at 3 and about 2.5x from 5 to 9 rows (benchmarks/spec_verify_cost.py, Zen 4), so one
    proposed token costs much of what eight do. An ``n`` not measured yet costs
    what the nearest measured larger one does (costs grow with ``n``), else the
    largest measured smaller one's plus the prior's per-token cost for each token
    more, else the method's prior.
    """

    def __init__(self, prior_token_cost: float) -> None:
        self.prior_token_cost = prior_token_cost
        self.plain_seconds: dict[int, float] = {}
        self.steps_since_plain: dict[int, int] = {}
        self._extra: dict[int, float] = {}  # proposed tokens in the step -> extra cost, in plain steps

    def extra_cost(self, num_tokens: int) -> float:
        """The extra cost, in plain steps, of a step that verifies ``num_tokens`` proposed tokens."""
        known = self._extra.get(num_tokens)
        if known is None:
            above = [n for n in self._extra if n > num_tokens]
            below = [n for n in self._extra if n < num_tokens]
            if above:
                known = self._extra[min(above)]
            elif below:
                # Beyond the longest measured: its cost plus, for each token more, the measured cost per
                # token between the two longest measured lengths (a draft model's forward per token),
                # at most the prior's. Not the measured one scaled up from zero: costs are concave in n,
                # and an estimate that grows with the dear first token would keep a request at one token.
                longest = max(below)
                known = self._extra[longest] + self._token_cost(longest) * (num_tokens - longest)
            else:
                known = self.prior_token_cost * num_tokens
        return max(0.0, known)

    def _token_cost(self, longest: int) -> float:
        """What one more proposed token adds beyond ``longest`` (measured): the slope from the next
        shorter measured length, clamped to [0, the prior's]; the prior's while only one is measured."""
        shorter = [n for n in self._extra if n < longest]
        if not shorter:
            return self.prior_token_cost
        previous = max(shorter)
        slope = (self._extra[longest] - self._extra[previous]) / (longest - previous)
        return min(self.prior_token_cost, max(0.0, slope))

    def observe(self, num_seqs: int, num_proposed: int, seconds: float) -> None:
        plain = self.plain_seconds.get(num_seqs)
        if num_proposed == 0:
            self.plain_seconds[num_seqs] = seconds if plain is None else _smooth(plain, seconds)
            self.steps_since_plain[num_seqs] = 0
            return
        self.steps_since_plain[num_seqs] = self.steps_since_plain.get(num_seqs, 0) + 1
        if plain is not None and plain > 0:
            extra = min(MAX_TOKEN_COST_SAMPLE * num_proposed, max(-1.0, seconds / plain - 1.0))
            old = self._extra.get(num_proposed)
            self._extra[num_proposed] = extra if old is None else _smooth(old, extra)

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
            state.restart_from(self.population)
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
        k = best_num_tokens(state.first, state.rest, self.costs.extra_cost, max_k)
        if state.probe_next:
            # A new request, or one back from sitting out: it proposes at least two tokens (where it
            # may) whatever the estimates say, so that its acceptance and the cost of a token are
            # measured anew (a cost inflated by a noisy step would otherwise never come down), and
            # the chance of the tokens after the first with them: a one-token probe never samples
            # it, and a prior that stays pessimistic would keep the request at one token.
            state.probe_next = False
            return max(min(PROBE_TOKENS, max_k), k)
        if k > 0:
            return k
        state.resume_at_step = self.num_steps + state.backoff_steps
        state.backoff_steps = min(2 * state.backoff_steps, MAX_BACKOFF_STEPS)
        state.probe_next = True
        # Back from sitting out, it starts from the prior again: its old acceptance is stale.
        state.restart_from(self.population)
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



def _smooth(average: float, sample: float) -> float:
    return (1.0 - COST_SMOOTHING) * average + COST_SMOOTHING * sample
