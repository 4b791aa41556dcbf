"""Conditional disaggregation's decisions on a fake cost model, and the cost model's online fit (no servers)."""

from __future__ import annotations

import pytest

from pdserve.gateway.disaggregation import (
    REASONS,
    DisaggregationPolicy,
    LinearCost,
    MeasuredCosts,
    RouteDecision,
    RouteInputs,
    StallLedger,
)


class FakeCosts:
    """Round numbers: 10 ms per prompt token on either side, a 100 ms hop to a prefill worker,
    a handoff of 50 ms + 1 ms per token, 20 ms per output token, streams of 51 tokens (1 s each)."""

    def remote_first_token_s(self, tokens: int) -> float:
        return 0.1 + 0.01 * tokens

    def handoff_s(self, tokens: int) -> float:
        return 0.05 + 0.001 * tokens

    def local_first_token_s(self, tokens: int) -> float:
        return 0.01 * tokens

    def decode_stall_s(self, tokens: int) -> float:
        return 0.01 * tokens

    def time_per_output_token_s(self) -> float:
        return 0.02

    def output_tokens(self) -> float:
        return 51.0


def _inputs(prompt: int, *, remote_cached: int = 0, local_cached: int = 0, prefill_queued: int = 0,
            decode_queued: int = 0, running: int = 0) -> RouteInputs:
    return RouteInputs(prompt, remote_cached, local_cached, prefill_queued, decode_queued, running)


def _auto(max_tpot_increase: float = 0.1) -> DisaggregationPolicy:
    return DisaggregationPolicy("auto", FakeCosts(), max_tpot_increase)


def test_an_idle_decode_worker_prefills_a_short_prompt_itself() -> None:
    # local 0.08 s against remote 0.1 + 0.08 + 0.05 + 0.008 = 0.238 s; 0.08 s would hold up a stream
    # handed to it meanwhile for 7.8% of its 1.02 s: within the 10% budget.
    decision = _auto().decide(_inputs(8))
    assert decision == RouteDecision("local", "decode_idle", remote_s=pytest.approx(0.238), local_s=pytest.approx(0.08),
                                     tpot_increase=pytest.approx(0.08 / 1.02), stall_s=pytest.approx(0.08))


def test_an_idle_decode_worker_leaves_a_long_prompt_to_a_prefill_worker() -> None:
    # local 10.00 s against remote 11.15 s answers first, but a stream handed to the decode worker during those
    # 10 s would wait for them all: 980% of its time per token. Nothing runs there now; the budget holds anyway.
    decision = _auto().decide(_inputs(1000))
    assert decision == RouteDecision("remote", "decode_stall", remote_s=pytest.approx(11.15), local_s=pytest.approx(10.0),
                                     tpot_increase=pytest.approx(10.0 / 1.02), stall_s=pytest.approx(10.0))


def test_a_short_prompt_goes_local_while_its_stall_stays_within_the_tpot_budget() -> None:
    # 8 tokens: 0.08 s of stall over a 1.02 s stream (51 tokens of 0.02 s) = 7.8% <= 10%.
    decision = _auto().decide(_inputs(8, running=4))
    assert (decision.route, decision.reason) == ("local", "cheaper")
    assert decision.tpot_increase == pytest.approx(0.08 / 1.02)
    assert (decision.local_s, decision.remote_s) == (pytest.approx(0.08), pytest.approx(0.1 + 0.08 + 0.05 + 0.008))


def test_a_long_prompt_goes_remote_when_streams_run_on_the_decode_worker() -> None:
    # 200 tokens: 2.0 s of stall = 196% of a stream's time: over budget although local answers first.
    decision = _auto().decide(_inputs(200, running=1))
    assert (decision.route, decision.reason) == ("remote", "decode_stall")
    assert decision.local_s < decision.remote_s


def test_the_threshold_is_where_the_stall_reaches_the_budget() -> None:
    # The budget of 10% of 1.02 s is 0.102 s: 10 uncached tokens fit, 11 do not.
    policy = _auto()
    assert policy.decide(_inputs(10, running=3)).route == "local"
    assert policy.decide(_inputs(11, running=3)).route == "remote"
    # A bigger budget moves the threshold with it.
    assert _auto(max_tpot_increase=0.5).decide(_inputs(50, running=3)).route == "local"
    assert _auto(max_tpot_increase=0.5).decide(_inputs(52, running=3)).route == "remote"


def test_the_decode_workers_prefix_hit_makes_a_long_prompt_local() -> None:
    # 1000 tokens, 992 cached on the decode worker, none on the prefill worker: 8 to compute here.
    decision = _auto().decide(_inputs(1000, local_cached=992, running=2))
    assert (decision.route, decision.reason) == ("local", "prefix_hit")
    assert decision.local_s == pytest.approx(0.08)
    # The same prompt cached on the prefill worker too: local is still cheaper (no hop, no handoff).
    decision = _auto().decide(_inputs(1000, remote_cached=992, local_cached=992, running=2))
    assert (decision.route, decision.reason) == ("local", "cheaper")


def test_a_long_decode_queue_sends_even_a_short_prompt_remote() -> None:
    # 500 prompt tokens already queued on the decode worker: 5.08 s there against 0.1 + 0.08 + 0.058 s remote.
    decision = _auto().decide(_inputs(8, decode_queued=500))
    assert (decision.route, decision.reason) == ("remote", "cheaper")
    assert decision.local_s == pytest.approx(5.08)


def test_a_long_prefill_queue_keeps_a_prompt_local_when_the_stall_is_within_budget() -> None:
    decision = _auto().decide(_inputs(10, prefill_queued=2000, running=1))
    assert (decision.route, decision.reason) == ("local", "cheaper")


def test_always_and_never_ignore_costs_and_prompt_logprobs_need_a_prefill_worker() -> None:
    inputs = _inputs(8)
    assert DisaggregationPolicy("always", FakeCosts()).decide(inputs) == RouteDecision("remote", "forced")
    assert DisaggregationPolicy("never", FakeCosts()).decide(_inputs(5000, running=9)) == RouteDecision("local", "forced")
    for mode in ("always", "never", "auto"):
        policy = DisaggregationPolicy(mode, FakeCosts())
        assert policy.decide(inputs, prompt_logprobs=True) == RouteDecision("remote", "prompt_logprobs")
    assert DisaggregationPolicy("auto", FakeCosts()).decide(None, has_prefill_worker=False) == RouteDecision(
        "local", "no_prefill_worker"
    )
    # always keeps its word: with no prefill worker the request fails (UNAVAILABLE) rather than going local.
    assert DisaggregationPolicy("always", FakeCosts()).decide(None, has_prefill_worker=False).route == "remote"


def test_every_reason_given_is_a_declared_label_value() -> None:
    policy = _auto()
    decisions = [policy.decide(_inputs(n, local_cached=c, decode_queued=q, running=r))
                 for n in (1, 8, 200, 1000) for c in (0, 992) for q in (0, 500) for r in (0, 3) if c < n]
    assert {d.reason for d in decisions} <= set(REASONS)
    assert {d.reason for d in decisions} == {"decode_idle", "cheaper", "decode_stall", "prefix_hit"}


def test_a_bad_mode_or_budget_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="disaggregation must be one of always, never, auto, got 'sometimes'"):
        DisaggregationPolicy("sometimes")
    with pytest.raises(ValueError, match="max_tpot_increase must be >= 0"):
        DisaggregationPolicy("auto", max_tpot_increase=-0.1)


def test_linear_cost_starts_at_its_prior_and_converges_to_the_measured_line() -> None:
    cost = LinearCost(fixed_s=1.0, per_token_s=1.0, decay=0.1)
    assert cost(10) == 11.0
    for _ in range(200):
        for tokens in (100, 400, 1000):
            cost.observe(tokens, 0.05 + 0.002 * tokens)
    assert cost.per_token_s == pytest.approx(0.002, rel=1e-6)
    assert cost.fixed_s == pytest.approx(0.05, rel=1e-5)
    assert cost.observations == 600


def test_linear_cost_at_a_single_length_keeps_its_slope_and_moves_its_level() -> None:
    cost = LinearCost(fixed_s=0.0, per_token_s=0.01, decay=0.5, prior_tokens=100)
    cost.observe(50, 2.0)
    # Observations at 0, 100 (prior, decayed) and 50 still spread: the fit moves toward the new point.
    assert cost(50) > 0.5
    assert cost.per_token_s >= 0.0 and cost.fixed_s >= 0.0


def test_measured_costs_learn_local_and_remote_prefill_and_the_handoff() -> None:
    costs = MeasuredCosts()
    for tokens in (32, 256, 1024) * 100:
        inputs = _inputs(tokens)
        costs.observe_request(RouteDecision("local", "cheaper"), inputs, 0.003 * tokens, 0.05, 0.05, 33)
        costs.observe_request(RouteDecision("remote", "cheaper"), inputs, 0.2 + 0.004 * tokens, 0.05 + 0.3 + 0.0005 * tokens,
                              0.05, 33)
    assert costs.local_first_token_s(500) == pytest.approx(1.5, rel=1e-3)
    assert costs.remote_first_token_s(500) == pytest.approx(2.2, rel=1e-3)
    # The gap to the second token less one decode step (the running mean of 0.05 s per token).
    assert costs.handoff_s(500) == pytest.approx(0.55, rel=1e-3)
    assert costs.decode_stall_s(100) == pytest.approx(0.3, rel=1e-3)
    assert costs.time_per_output_token_s() == pytest.approx(0.05)
    assert costs.output_tokens() == pytest.approx(33.0)


def test_request_timing_measures_first_token_second_token_gap_and_time_per_token_from_the_second() -> None:
    from pdserve.gateway.prefill_route import RequestTiming
    from pdserve.protos.pdserve.v1 import generation_pb2

    now = [10.0]
    timing = RequestTiming(clock=lambda: now[0])
    for at, tokens in ((10.5, [1]), (11.3, [2]), (11.4, []), (11.5, [3, 4]), (11.7, [5])):
        now[0] = at
        timing.responded(generation_pb2.GenerateResponse(token_ids=tokens))
    assert timing.first_token_s == pytest.approx(0.5)
    assert timing.second_token_gap_s == pytest.approx(0.8)
    # Tokens 3..5 came 0.4 s after the second: 0.4 / 3.
    assert timing.time_per_output_token_s == pytest.approx(0.4 / 3)
    assert timing.num_tokens == 5


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _auto_with_clock() -> tuple[DisaggregationPolicy, FakeClock]:
    policy, clock = _auto(), FakeClock()
    policy.stalls = StallLedger(clock)
    return policy, clock


def test_local_prefills_sent_to_one_decode_worker_add_up_against_the_stall_budget() -> None:
    # Each 5-token prompt stalls 0.05 s of a 1.02 s stream (4.9%): alone within the 10% budget,
    # but a stream running there sees every one of them. The third within a stream's life would
    # make 0.15 s (14.7%), so it goes remote.
    policy, clock = _auto_with_clock()
    first = policy.route("d0:1", _inputs(5, running=2))
    assert (first.route, first.stall_s, first.tpot_increase) == ("local", pytest.approx(0.05), pytest.approx(0.05 / 1.02))
    clock.now += 0.3
    second = policy.route("d0:1", _inputs(5, running=2))
    assert (second.route, second.tpot_increase) == ("local", pytest.approx(0.10 / 1.02))
    clock.now += 0.3
    third = policy.route("d0:1", _inputs(5, running=2))
    assert (third.route, third.reason, third.tpot_increase) == ("remote", "decode_stall", pytest.approx(0.15 / 1.02))
    # Another decode worker's streams absorbed none of them.
    assert policy.route("d1:1", _inputs(5, running=2)).route == "local"
    # A stream's duration (1.02 s) after the first two, their stalls no longer reach any running stream.
    clock.now += 1.02
    fourth = policy.route("d0:1", _inputs(5, running=2))
    assert (fourth.route, fourth.tpot_increase) == ("local", pytest.approx(0.05 / 1.02))


def test_a_remote_decision_records_no_stall_and_a_local_one_on_an_idle_decode_worker_does() -> None:
    policy, clock = _auto_with_clock()
    assert policy.route("d0:1", _inputs(200, running=1)).route == "remote"  # over budget: nothing recorded
    assert policy.stalls.recent_s("d0:1", window_s=10.0) == 0.0
    # Nothing runs there, but a stream handed over within the next 0.05 s waits for this prefill.
    assert policy.route("d0:1", _inputs(5)).reason == "decode_idle"
    assert policy.stalls.recent_s("d0:1", window_s=10.0) == pytest.approx(0.05)
    decision = policy.route("d0:1", _inputs(5, running=3))
    assert (decision.route, decision.tpot_increase) == ("local", pytest.approx(0.1 / 1.02))
    assert policy.stalls.recent_s("d0:1", window_s=10.0) == pytest.approx(0.1)
    clock.now += 10.5
    assert policy.stalls.recent_s("d0:1", window_s=10.0) == 0.0
