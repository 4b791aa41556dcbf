"""Adaptive speculation decides each request's proposal length from its acceptance and the measured step
costs: exact decisions for fake acceptances and costs, and an engine that stops proposing when verifying
costs more than it yields while producing the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.adaptive import (
    FIRST_BACKOFF_STEPS,
    PRIOR_TOKEN_COST,
    PROBE_TOKENS,
    RECALIBRATE_EVERY,
    AdaptivePolicy,
    RequestAcceptance,
    best_num_tokens,
    expected_tokens,
)
from pdserve.engine.types.speculative import SpeculativeConfig
from tests.conftest import VOCAB_SIZE, Oracle, random_prompts
from tests.support.proposers import ScriptedProposer

MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    """The controller under test decides from acceptance and a fake clock, whatever the family: two checkpoints
    whose scripted runs reach every step these tests count (no early EOS)."""
    return request.getfixturevalue(f"{request.param}_checkpoint")


def _seq(request_id: str = "r") -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=64, temperature=0.0), block_size=4, model_id="m")


def _calibrated(plain_seconds: float = 1.0) -> AdaptivePolicy:
    policy = AdaptivePolicy("ngram")
    policy.observe_step(1, 0, plain_seconds)
    return policy


@pytest.mark.parametrize(
    ("acceptance", "token_cost", "max_k", "expected"),
    [
        (0.9, 0.05, 8, 8),  # a copying request: the whole proposal pays
        (0.5, 0.05, 8, 3),  # the prior
        (0.2, 0.05, 8, 1),  # chat-like acceptance: one token still pays
        (0.02, 0.05, 8, 0),  # below the cost of one token: nothing
        (0.5, 0.4, 8, 1),  # an expensive draft shortens the proposal
        (0.97, 0.4, 5, 5),  # ... unless it is nearly always right
        (0.5, 0.0, 4, 4),  # free tokens: as many as allowed
        (0.05, 0.05, 8, 0),  # a tie with plain decoding: the shorter (none)
    ],
)
def test_best_num_tokens_maximises_tokens_per_unit_of_cost(
    acceptance: float, token_cost: float, max_k: int, expected: int
) -> None:
    # The same rate for the first token and the rest: the geometric case.
    assert best_num_tokens(acceptance, acceptance, lambda k: token_cost * k, max_k) == expected


def test_a_first_token_that_costs_most_of_a_long_proposal_is_not_worth_a_short_bet() -> None:
    # Measured shape at one thread: a second row costs half a plain step, further ones little.
    def extra(k: int) -> float:
        return 0.5 + 0.02 * (k - 1)

    assert best_num_tokens(0.3, 0.3, lambda k: 0.2 * k, 8) == 1  # a per-token model would bet one token
    assert best_num_tokens(0.3, 0.3, extra, 8) == 0
    assert best_num_tokens(0.8, 0.8, extra, 8) == 8  # and a likely run pays for the whole proposal


def test_a_copying_request_keeps_its_long_proposals_after_a_chance_miss() -> None:
    # First tokens kept 3 times in 4, runs after a kept first token nearly always right: all 8.
    assert best_num_tokens(0.75, 0.97, lambda k: 0.2 * k, 8) == 8
    # One rate for both (0.75 per token) would have cut the proposal to 3.
    assert best_num_tokens(0.75, 0.75, lambda k: 0.2 * k, 8) == 3


def test_expected_tokens_counts_the_target_token_after_the_run() -> None:
    assert expected_tokens(0.5, 0.5, 0) == 1.0
    assert expected_tokens(0.5, 0.5, 3) == 1.875
    assert expected_tokens(1.0, 1.0, 4) == 5.0
    assert expected_tokens(0.2, 0.5, 3) == pytest.approx(1.0 + 0.2 * 1.75)


def test_acceptance_counts_decay_with_the_first_token_apart_from_the_rest() -> None:
    state = RequestAcceptance()
    assert (state.first, state.rest) == (0.5, 0.5)
    state.observe(8, 3)  # first kept, two more kept, then one rejected
    assert (state.first_hits, state.first_misses, state.rest_hits, state.rest_misses) == pytest.approx(
        (1.8, 0.8, 2.8, 1.8)
    )
    state.observe(4, 0)  # first rejected: says nothing about the rest
    assert (state.first_hits, state.first_misses, state.rest_hits, state.rest_misses) == pytest.approx(
        (1.44, 1.64, 2.8, 1.8)
    )
    state.observe(3, 3)  # all kept: no rejection
    assert (state.first_hits, state.first_misses, state.rest_hits, state.rest_misses) == pytest.approx(
        (2.152, 1.312, 4.24, 1.44)
    )


def test_nobody_proposes_until_a_plain_step_was_timed_then_the_prior_decides() -> None:
    policy = AdaptivePolicy("ngram")
    seq = _seq()
    assert policy.limits([seq], [8], num_seqs=1) == [0]
    policy.observe_step(1, 0, 0.010)
    assert policy.costs.extra_cost(3) == pytest.approx(3 * PRIOR_TOKEN_COST["ngram"])
    assert policy.limits([seq], [8], num_seqs=1) == [3]  # acceptance 0.5, cost 0.05
    assert policy.limits([seq], [2], num_seqs=1) == [2]  # never above the sequence's own limit
    assert policy.limits([seq], [8], num_seqs=2) == [0]  # a batch size not timed yet


def test_the_extra_cost_of_a_proposal_is_measured_per_length_against_the_plain_step() -> None:
    policy = _calibrated(plain_seconds=0.010)
    policy.observe_step(1, 4, 0.014)  # 4 tokens cost 0.4 plain steps
    costs = policy.costs
    # 2: as 4 (costs grow with the length); 8: 4's plus the prior's 0.05 for each token more.
    assert [costs.extra_cost(n) for n in (4, 2, 8)] == pytest.approx([0.4, 0.4, 0.6])
    policy.observe_step(1, 4, 0.008)  # faster than plain (noise): averaged in, with weight 0.2
    assert costs.extra_cost(4) == pytest.approx(0.8 * 0.4 + 0.2 * -0.2)
    policy.observe_step(1, 2, None)  # a step with prompt tokens in it: no sample
    assert costs.extra_cost(2) == pytest.approx(0.28)
    policy.observe_step(1, 1, 1.0)  # a stalled step counts as at most 2 plain steps per token
    assert costs.extra_cost(1) == 2.0


def test_beyond_the_longest_measured_length_a_token_costs_the_measured_slope_at_most_the_prior() -> None:
    policy = AdaptivePolicy("draft_model")  # prior: 0.4 plain steps a token
    policy.observe_step(1, 0, 1.0)
    policy.observe_step(1, 1, 1.25)
    costs = policy.costs
    assert costs.extra_cost(3) == pytest.approx(0.25 + 2 * 0.4)  # one length measured: the prior per token
    policy.observe_step(1, 2, 1.45)
    assert costs.extra_cost(4) == pytest.approx(0.45 + 2 * 0.2)  # 1 -> 2 cost 0.2 a token
    policy.observe_step(1, 3, 2.45)  # 2 -> 3 cost 1.0 (a stalled step): the prior's 0.4 at most
    assert costs.extra_cost(5) == pytest.approx(1.45 + 2 * 0.4)
    policy.observe_step(1, 4, 1.2)  # cheaper than 3 (noise): never a negative cost per token
    assert costs.extra_cost(6) == pytest.approx(0.2)


def test_a_draft_whose_proposals_are_kept_grows_from_its_probe_to_its_full_limit() -> None:
    # A draft model: each proposed token costs a draft forward, 0.2 plain steps (the prior says 0.4).
    # One-token probes never sampled the rate of the tokens after the first: it stayed at its prior
    # 0.5 and the request at one token (benchmarks/spec_decode.py on a Cooper Lake Xeon: mean accepted length 1.99).
    policy = AdaptivePolicy("draft_model")
    policy.observe_step(1, 0, 1.0)
    seq = _seq()
    limits = []
    for _ in range(10):
        k = policy.limits([seq], [8], num_seqs=1)[0]
        limits.append(k)
        policy.observe_verified(seq, k, k)
        policy.observe_step(1, k, 1.0 + 0.05 + 0.2 * k)
    # Two tokens while three are estimated at the prior's cost (0.45 + 0.4), until the run's rate is
    # high enough; once 3 is measured (0.65: 0.2 a token over 2) the longer ones are estimated at that.
    assert limits == [2, 2, 2, 2, 2, 3, 8, 8, 8, 8]


def test_a_request_that_keeps_being_rejected_sits_out_then_probes_with_a_doubling_back_off() -> None:
    policy = _calibrated()
    for k in range(1, 5):  # every proposal length measured at 0.05 plain steps per token
        policy.observe_step(1, k, 1.0 + 0.05 * k)
    seq = _seq()
    limits = []
    for _ in range(7):
        limits.append(policy.limits([seq], [4], num_seqs=1)[0])
        policy.observe_verified(seq, limits[-1], 0)
        policy.observe_step(1, limits[-1], 1.0 + 0.05 * limits[-1])
    assert limits == [3, 3, 2, 2, 2, 1, 1]
    # Its first tokens' rate is now 0.048, the run's after them still the prior 0.5: a token costs 0.05
    # and yields 0.048, none pays: it sits out FIRST_BACKOFF_STEPS steps.
    sat_out = 0
    while (probe := policy.limits([seq], [4], num_seqs=1)) == [0]:
        sat_out += 1
        policy.observe_step(1, 0, 1.0)
    # The probe starts again from the engine's acceptance over all requests (0.096 after these 7
    # failures, worth 2 tokens): it proposes 2, a probe's least (0 would pay more).
    assert policy.population.first == pytest.approx(0.95**7 / (2 * 0.95**7 + sum(0.95**i for i in range(7))))
    assert (sat_out, probe) == (FIRST_BACKOFF_STEPS, [PROBE_TOKENS])
    # It fails, and so do the next ones until the estimate says stop; then it sits out twice as long.
    policy.observe_verified(seq, PROBE_TOKENS, 0)
    proposals = 1
    while policy.limits([seq], [4], num_seqs=1) != [0]:
        proposals += 1
        policy.observe_verified(seq, 1, 0)
    sat_out = 0
    while policy.limits([seq], [4], num_seqs=1) == [0]:
        sat_out += 1
        policy.observe_step(1, 0, 1.0)
    assert (proposals, sat_out) == (2, 2 * FIRST_BACKOFF_STEPS)


def test_a_new_request_starts_from_the_engines_recent_acceptance() -> None:
    policy = _calibrated()
    copying = _seq("copying")
    for _ in range(10):
        policy.observe_verified(copying, 8, 8)
    # Population: (0.95**10 + 8 * sum(0.95**i)) accepted against 0.95**10 rejected: 0.99; worth 2 tokens.
    assert policy.limits([_seq("new")], [8], num_seqs=1) == [8]
    chatty = _calibrated()
    for _ in range(10):
        chatty.observe_verified(_seq("old"), 2, 0)
    assert chatty.limits([_seq("new")], [8], num_seqs=1) == [PROBE_TOKENS]  # a probe, though 0 would pay more
    assert chatty.limits([_seq("short")], [1], num_seqs=1) == [1]  # never past the sequence's own limit


def test_an_accepted_token_resets_the_back_off() -> None:
    policy = _calibrated()
    seq = _seq()
    state = policy.acceptance_of(seq)
    state.backoff_steps = 32
    policy.observe_verified(seq, 2, 1)
    assert state.backoff_steps == FIRST_BACKOFF_STEPS


def test_the_plain_cost_is_measured_again_after_many_speculating_steps() -> None:
    policy = _calibrated()
    seq = _seq()
    for _ in range(RECALIBRATE_EVERY):
        assert policy.limits([seq], [4], num_seqs=1) != [0]
        policy.observe_verified(seq, 4, 4)
        policy.observe_step(1, 4, 1.2)
    assert policy.limits([seq], [4], num_seqs=1) == [0]
    policy.observe_step(1, 0, 1.0)
    assert policy.limits([seq], [4], num_seqs=1) == [4]


def test_adaptive_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="speculative_config.adaptive must be a bool"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"})


def _timed_by_fake_clock(llm: LLM, plain_cost: float, token_cost: float) -> None:
    """Steps cost ``plain_cost`` plus ``token_cost`` per verified proposed token, on a fake clock."""
    spec = llm.engine.spec_decoder
    assert spec is not None
    now = [0.0]
    spec.clock = lambda: now[0]
    execute = llm.engine.runner.execute

    def timed(output: SchedulerOutput) -> object:
        now[0] += plain_cost + token_cost * sum(len(item.spec_token_ids) for item in output.scheduled)
        return execute(output)

    llm.engine.runner.execute = timed  # type: ignore[method-assign]


def _scripted_llm(
    checkpoint: Path, oracle: Oracle, prompt: list[int], wrong_at: set[int]
) -> tuple[LLM, ScriptedProposer]:
    config = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True}
    llm = LLM(model=str(checkpoint), dtype="float32", num_kv_blocks=64, speculative_config=config)
    proposer = ScriptedProposer({tuple(prompt): oracle.generate(prompt, MAX_TOKENS)}, wrong_at, VOCAB_SIZE)
    assert llm.engine.spec_decoder is not None
    llm.engine.spec_decoder.proposer = proposer
    return llm, proposer


def test_an_engine_stops_proposing_once_verifying_costs_more_than_it_yields(checkpoint: Path, oracle: Oracle) -> None:
    prompt = random_prompts([12], seed=5)[0]
    llm, proposer = _scripted_llm(checkpoint, oracle, prompt, wrong_at=set(range(MAX_TOKENS)))
    _timed_by_fake_clock(llm, plain_cost=1.0, token_cost=10.0)
    (got,) = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert got.token_ids == oracle.generate(prompt, MAX_TOKENS)
    # Step 1 prefills, step 2 is the plain step that calibrates, step 3 verifies the new request's 3 tokens
    # (10 plain steps each): from then on a token costs over 2 plain steps, more than any run can yield.
    # It sits out 4 steps, probes with two tokens (output 7), sits out 8, probes (output 16), sits out 16.
    assert [(done, len(proposal)) for _, done, proposal in proposer.calls] == [(2, 3), (7, 2), (16, 2)]
    assert (got.spec_decode_stats.num_drafts, got.spec_decode_stats.num_draft_tokens) == (3, 7)


def test_an_engine_whose_proposals_are_right_and_cheap_proposes_its_full_limit(
    checkpoint: Path, oracle: Oracle
) -> None:
    prompt = random_prompts([12], seed=5)[0]
    llm, proposer = _scripted_llm(checkpoint, oracle, prompt, wrong_at=set())
    _timed_by_fake_clock(llm, plain_cost=1.0, token_cost=0.1)
    (got,) = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert got.token_ids == oracle.generate(prompt, MAX_TOKENS)
    # The prior's 3 tokens after the calibrating plain step, all kept (first-token rate then 0.69, the
    # rest's 0.78; 3 tokens measured at 0.3 plain steps, 4 estimated at 0.35): then the full 4 every
    # step, until max_tokens leaves room for 2.
    calls = [(done, len(proposal)) for _, done, proposal in proposer.calls]
    assert calls == [(2, 3), (6, 4), (11, 4), (16, 4), (21, 2)]
