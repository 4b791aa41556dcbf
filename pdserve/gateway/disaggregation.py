"""Conditional disaggregation: prefill a request on a prefill worker (remote) or on its decode worker (local).

Remote prefill keeps long prompts from stalling the streams that run on the
decode worker, at the price of a second hop and a KV handoff before the
second token. Local prefill has neither cost, but every step that computes
prompt tokens on the decode worker delays each of its running streams by as
much. The policy compares the two with a cost model whose costs are measured
by this gateway as requests complete (``MeasuredCosts``), so the threshold
moves with the hardware, the model and the load instead of being a constant:

- a request goes local when the decode worker would give it its first token
  no later than a prefill worker plus the handoff would (the decode worker's
  own prefix-cache hit and both sides' queues are in these estimates), and
  the stall it causes adds at most ``max_tpot_increase`` (a fraction) to the
  time per output token of the streams running there. A stream is stalled by
  every local prefill during its life, not by one: the stall counted is this
  prefill's plus those of the local prefills sent to the same decode worker
  within one stream's duration (``StallLedger``), so a stream of short local
  prefills cannot add up past the budget one by one. An idle decode worker is
  no exception: a stream handed to it while it computes a prompt waits for
  that prompt as a running one would (counting it there is what brought
  auto's TPOT p99 near the always-disaggregated layout's in the rate sweep:
  benchmarks/disaggregation_sweep.py, BENCHMARKS.md);
- otherwise remote. ``always`` and ``never`` skip the comparison.

vLLM and Dynamo prefill short or mostly-cached prompts on the decode worker
the same way (Dynamo with a fixed length and queue threshold).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

MODES = ("always", "never", "auto")
REMOTE, LOCAL = "remote", "local"
# Every reason a decision can give (the metric's label values).
REASONS = (
    "forced",  # --disaggregation always / never
    "no_prefill_worker",  # auto and never: no healthy prefill worker, so the decode worker prefills
    "prompt_logprobs",  # only a prefill worker returns prompt logprobs
    "prefix_hit",  # auto: local, and the decode worker caches more of the prompt than the prefill worker
    "decode_idle",  # auto: local: nothing runs on the decode worker, it answers first, and the stall is within budget
    "cheaper",  # auto: the chosen side answers first and (local) stays within the stall budget
    "decode_stall",  # auto: local would answer first but stall the running streams past the budget
)


@dataclass(frozen=True)
class RouteInputs:
    """What the gateway knows about one request and the two candidate workers when it routes it."""

    prompt_tokens: int
    remote_cached_tokens: int  # what the best prefill worker caches of the prompt (per the Redis index)
    local_cached_tokens: int  # what the chosen decode worker caches of it
    prefill_queued_tokens: int  # uncomputed prompt tokens already queued at that prefill worker
    decode_queued_tokens: int  # uncomputed prompt tokens already queued at the decode worker (its local prefills)
    decode_running: int  # streams running on the decode worker
    # Stall seconds the local prefills already sent to that decode worker put on its streams within
    # one stream's duration (``StallLedger``); ``DisaggregationPolicy.route`` fills it in.
    recent_stall_s: float = 0.0


@dataclass(frozen=True)
class RouteDecision:
    """The route, why, and the estimates that decided it (seconds; 0 where not estimated)."""

    route: str  # REMOTE or LOCAL
    reason: str  # one of REASONS
    remote_s: float = 0.0  # first token from the prefill worker plus the handoff
    local_s: float = 0.0  # first token from the decode worker
    tpot_increase: float = 0.0  # what the local prefill would add to a stream's time per token there, as a fraction
    stall_s: float = 0.0  # how long the local prefill would hold up each stream running there (or arriving meanwhile)

    @property
    def local(self) -> bool:
        return self.route == LOCAL


class CostModel(Protocol):
    """The costs the policy weighs, in seconds; ``MeasuredCosts`` learns them, tests pass fixed ones."""

    def remote_first_token_s(self, tokens: int) -> float:
        """First token from a prefill worker with ``tokens`` to compute (its queue and this prompt's uncached part)."""

    def handoff_s(self, tokens: int) -> float:
        """What a remote prefill adds before the second token: moving ``tokens`` tokens' KV to the decode worker."""

    def local_first_token_s(self, tokens: int) -> float:
        """First token from the decode worker when it has ``tokens`` prompt tokens to compute."""

    def decode_stall_s(self, tokens: int) -> float:
        """How long computing ``tokens`` prompt tokens on the decode worker holds up each stream running there."""

    def time_per_output_token_s(self) -> float:
        """The decode worker's time per output token of a running stream."""

    def output_tokens(self) -> float:
        """How many tokens a stream generates (the stall is spread over them)."""


class DisaggregationPolicy:
    """Decides per request where its prompt is prefilled; ``mode`` is one of ``MODES``."""

    def __init__(self, mode: str = "auto", costs: CostModel | None = None, max_tpot_increase: float = 0.1) -> None:
        if mode not in MODES:
            raise ValueError(f"disaggregation must be one of {', '.join(MODES)}, got {mode!r}")
        if max_tpot_increase < 0:
            raise ValueError(f"max_tpot_increase must be >= 0, got {max_tpot_increase}")
        self.mode = mode
        self.costs: CostModel = costs if costs is not None else MeasuredCosts()
        self.max_tpot_increase = max_tpot_increase
        self.stalls = StallLedger()

    def route(self, decode_worker: str, inputs: RouteInputs) -> RouteDecision:  # decode_worker: its address
        """``decide`` (auto) for a prompt headed to ``decode_worker``, weighing the stalls already sent there."""
        window_s = self._stream_s()
        recent = self.stalls.recent_s(decode_worker, window_s)
        decision = self.decide(replace(inputs, recent_stall_s=recent))
        if decision.local and decision.stall_s > 0:
            self.stalls.record(decode_worker, decision.stall_s)
        return decision

    def decide(self, inputs: RouteInputs | None, *, has_prefill_worker: bool = True,
               prompt_logprobs: bool = False) -> RouteDecision:
        """``inputs`` may be None where the route does not depend on them (``always``, no prefill worker)."""
        if prompt_logprobs:
            return RouteDecision(REMOTE, "prompt_logprobs")
        if self.mode == "always":
            return RouteDecision(REMOTE, "forced")
        if not has_prefill_worker:
            return RouteDecision(LOCAL, "no_prefill_worker")
        if self.mode == "never":
            return RouteDecision(LOCAL, "forced")
        assert inputs is not None, "auto needs the route inputs"
        return self._compare(inputs)

    def _compare(self, inputs: RouteInputs) -> RouteDecision:
        costs = self.costs
        # One token is always computed, however much of the prompt is cached.
        local_uncached = max(1, inputs.prompt_tokens - inputs.local_cached_tokens)
        remote_uncached = max(1, inputs.prompt_tokens - inputs.remote_cached_tokens)
        # Only the blocks the decode worker lacks travel.
        remote_s = (costs.remote_first_token_s(inputs.prefill_queued_tokens + remote_uncached)
                    + costs.handoff_s(local_uncached))
        local_s = costs.local_first_token_s(inputs.decode_queued_tokens + local_uncached)
        # Counted with no stream running too: one that arrives during the prefill waits for it all the same.
        stall = costs.decode_stall_s(local_uncached)
        increase = (inputs.recent_stall_s + stall) / self._stream_s()
        decision = {"remote_s": remote_s, "local_s": local_s, "tpot_increase": increase, "stall_s": stall}
        if local_s > remote_s:
            return RouteDecision(REMOTE, "cheaper", **decision)
        if increase > self.max_tpot_increase:
            return RouteDecision(REMOTE, "decode_stall", **decision)
        if inputs.local_cached_tokens > inputs.remote_cached_tokens:
            reason = "prefix_hit"
        else:
            reason = "cheaper" if inputs.decode_running else "decode_idle"
        return RouteDecision(LOCAL, reason, **decision)

    def _stream_s(self) -> float:
        """How long a stream runs on a decode worker: the window over which stalls add up."""
        return self.costs.time_per_output_token_s() * max(1.0, self.costs.output_tokens())


class StallLedger:
    """The stalls local prefills put on each decode worker's streams, by when they were routed.

    Only the last window (one stream's duration) matters: a stream running now
    started within it, so it absorbs at most the stalls recorded there.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._stalls: dict[str, deque[tuple[float, float]]] = {}  # worker -> (routed at, stall seconds), oldest first

    def record(self, worker: str, stall_s: float) -> None:
        self._stalls.setdefault(worker, deque()).append((self._clock(), stall_s))

    def recent_s(self, worker: str, window_s: float) -> float:
        """The stall seconds recorded for ``worker`` within the last ``window_s`` seconds (older ones are dropped)."""
        stalls = self._stalls.get(worker)
        if not stalls:
            return 0.0
        horizon = self._clock() - window_s
        while stalls and stalls[0][0] < horizon:
            stalls.popleft()
        if not stalls:
            del self._stalls[worker]  # a worker that left does not stay here
            return 0.0
        return sum(stall for _, stall in stalls)


class LinearCost:
    """``seconds = fixed_s + per_token_s * tokens``, refitted as observations arrive.

    Exponentially weighted least squares: each observation weighs 1 and every
    earlier one decays by ``1 - decay``, so the fit follows a load that
    changes. The prior enters as two pseudo-observations (at 0 and at
    ``prior_tokens`` tokens) of ``prior_weight`` each, which decay like the rest:
    a few real observations outweigh it. Neither coefficient goes below 0.
    """

    def __init__(self, fixed_s: float, per_token_s: float, decay: float = 0.05, prior_weight: float = 2.0,
                 prior_tokens: int = 512) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.fixed_s, self.per_token_s = fixed_s, per_token_s
        self.observations = 0
        # Weighted sums: weight, x, y, x*x, x*y.
        self._sums = [0.0] * 5
        for tokens in (0, prior_tokens):
            self._add(tokens, fixed_s + per_token_s * tokens, prior_weight)

    def __call__(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def observe(self, tokens: int, seconds: float) -> None:
        self._sums = [s * (1 - self.decay) for s in self._sums]
        self._add(tokens, seconds, 1.0)
        self.observations += 1
        weight, x, y, xx, xy = self._sums
        spread = weight * xx - x * x
        if spread <= 1e-9 * max(1.0, weight * xx):
            return  # every observation at one length: keep the slope, move the level
        slope = max(0.0, (weight * xy - x * y) / spread)
        self.per_token_s = slope
        self.fixed_s = max(0.0, (y - slope * x) / weight)

    def _add(self, tokens: float, seconds: float, weight: float) -> None:
        sums = self._sums
        sums[0] += weight
        sums[1] += weight * tokens
        sums[2] += weight * seconds
        sums[3] += weight * tokens * tokens
        sums[4] += weight * tokens * seconds


class RunningMean:
    """An exponentially weighted mean that starts at ``initial``."""

    def __init__(self, initial: float, decay: float = 0.05) -> None:
        self.value, self.decay = initial, decay

    def __call__(self) -> float:
        return self.value

    def observe(self, value: float) -> None:
        self.value += self.decay * (value - self.value)


class MeasuredCosts:
    """The cost model learnt from this gateway's own requests.

    - remote first token: each remote request's time to first token against the
      tokens its prefill worker had to compute (queued ahead of it plus its own
      uncached ones);
    - handoff: the gap between a remote request's first and second tokens, less
      one decode step, against the tokens whose KV travelled;
    - local first token: each local request's time to first token against the
      prompt tokens its decode worker had to compute;
    - decode stall: the local first-token cost per token (a prompt token
      computed on the decode worker costs its running streams what it costs the
      prompt), time per output token and stream length: running means over
      finished requests.

    The defaults are only a start (measured on this project's 2-core CPU machine
    with the default model); they decay away after a few dozen requests.
    """

    def __init__(self) -> None:
        self.remote = LinearCost(fixed_s=0.05, per_token_s=0.002)
        self.handoff = LinearCost(fixed_s=0.1, per_token_s=0.0002)
        self.local = LinearCost(fixed_s=0.02, per_token_s=0.002)
        self.tpot = RunningMean(0.08)
        self.stream_tokens = RunningMean(64.0)

    def remote_first_token_s(self, tokens: int) -> float:
        return self.remote(tokens)

    def handoff_s(self, tokens: int) -> float:
        return self.handoff(tokens)

    def local_first_token_s(self, tokens: int) -> float:
        return self.local(tokens)

    def decode_stall_s(self, tokens: int) -> float:
        return self.local.per_token_s * tokens

    def time_per_output_token_s(self) -> float:
        return self.tpot()

    def output_tokens(self) -> float:
        return self.stream_tokens()

    def observe_request(self, decision: RouteDecision, inputs: RouteInputs, first_token_s: float,
                        second_token_gap_s: float | None, time_per_output_token_s: float | None,
                        output_tokens: int) -> None:
        """One finished request: how long its first token took, the gap to its second, its decode speed."""
        local_uncached = max(1, inputs.prompt_tokens - inputs.local_cached_tokens)
        if decision.local:
            self.local.observe(inputs.decode_queued_tokens + local_uncached, first_token_s)
        else:
            remote_uncached = max(1, inputs.prompt_tokens - inputs.remote_cached_tokens)
            self.remote.observe(inputs.prefill_queued_tokens + remote_uncached, first_token_s)
            if second_token_gap_s is not None:
                self.handoff.observe(local_uncached, max(0.0, second_token_gap_s - self.tpot()))
        if time_per_output_token_s is not None:
            self.tpot.observe(time_per_output_token_s)
        if output_tokens > 1:
            self.stream_tokens.observe(output_tokens)
