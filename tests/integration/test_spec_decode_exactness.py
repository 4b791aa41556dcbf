"""Speculative decoding never changes what a request produces: greedy output equals transformers' through
every engine path, stop conditions cut inside accepted runs where plain decoding stops, and the blocks held
after every step are those plain decoding would hold."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.spec_decode.decoder import SpecDecoder
from tests.conftest import EOS_TOKEN_ID, VOCAB_SIZE, Oracle, preempting_pool, random_prompts
from tests.support.handoff import handoff_tokens
from tests.support.proposers import ScriptedProposer

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Wrong proposed tokens at these output indices: runs of every accepted length from 0 to 4 occur.
WRONG_AT = {2, 3, 5, 9, 14, 15, 16, 22}


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", **kwargs)


def _repetitive_prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so that n-gram lookup finds something to propose."""
    return [p + p[: len(p) // 2] for p in random_prompts([3, 8, 17, 30, 61], seed=seed)]


def _scripted(llm: LLM, oracle: Oracle, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> ScriptedProposer:
    spec = llm.engine.spec_decoder
    assert spec is not None
    proposer = ScriptedProposer({tuple(p): oracle.generate(p, max_tokens) for p in prompts}, WRONG_AT, VOCAB_SIZE)
    spec.proposer = proposer
    return proposer


def _assert_matches_oracle(outputs: list, prompts: list[list[int]], oracle: Oracle) -> None:
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == oracle.generate(prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


def _assert_no_block_held(llm: LLM) -> None:
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_ngram_greedy_equals_transformers_in_a_batch(checkpoint: Path, oracle: Oracle) -> None:
    prompts = _repetitive_prompts(seed=21)
    llm = _llm(checkpoint, num_kv_blocks=256, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    outputs = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(outputs, prompts, oracle)
    stats = [o.spec_decode_stats for o in outputs]
    assert sum(s.num_drafts for s in stats) > 0
    engine_stats = llm.engine.stats()
    assert engine_stats.spec_num_drafts == sum(s.num_drafts for s in stats)
    assert engine_stats.spec_num_accepted_tokens == sum(s.num_accepted_tokens for s in stats) > 0
    _assert_no_block_held(llm)


def test_scripted_proposals_equal_transformers_with_chunked_prefill_and_prefix_hits(
    checkpoint: Path, oracle: Oracle
) -> None:
    shared = random_prompts([40], seed=22)[0]
    prompts = [shared + suffix for suffix in random_prompts([1, 9, 16, 30, 3], seed=23)]
    # 24 tokens per step: prompts take several chunks, and proposals are cut to what is left of the budget.
    llm = _llm(
        checkpoint, num_kv_blocks=256, max_num_batched_tokens=24,
        speculative_config={**NGRAM, "disable_by_batch_size": 8},
    )
    proposer = _scripted(llm, oracle, prompts)
    first = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(first, prompts, oracle)
    second = llm.generate(prompts, GREEDY)  # every full prompt block is a prefix hit now
    _assert_matches_oracle(second, prompts, oracle)
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 16 * 16 for p in prompts]
    accepted = {s.num_accepted_tokens for o in first + second if (s := o.spec_decode_stats)}
    assert max(accepted) > 0 and proposer.calls
    _assert_no_block_held(llm)


def test_speculation_under_preemption_equals_transformers(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([1, 5, 16, 17, 40, 95, 160, 200], seed=24)
    llm = _llm(
        checkpoint, num_kv_blocks=preempting_pool(checkpoint), block_size=16, enable_prefix_caching=False,
        speculative_config={**NGRAM, "disable_by_batch_size": 16},
    )
    _scripted(llm, oracle, prompts)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_matches_oracle(outputs, prompts, oracle)
    assert sum(o.spec_decode_stats.num_accepted_tokens for o in outputs) > 0
    _assert_no_block_held(llm)


def _run_checking_blocks(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Generate step by step; after every step each running sequence holds exactly the blocks its computed
    tokens need (plain decoding's invariant), and nothing else is taken from the pool."""
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        running = engine.scheduler.running
        for seq in running:
            assert len(seq.block_table) == -(-seq.num_computed_tokens // engine.block_size), seq.request_id
            assert seq.num_computed_tokens == seq.num_tokens - 1 or seq.num_computed_tokens < seq.num_prompt_tokens
        held = {b for seq in running for b in seq.block_table}
        assert engine.block_manager.num_used_blocks == len(held)
    return {request_id: outputs[request_id] for request_id in ids}


def test_rejected_positions_release_their_blocks_and_only_accepted_tokens_are_cached(
    checkpoint: Path, oracle: Oracle
) -> None:
    # Prompt lengths put the last prompt token at every offset around a block boundary (block size 4).
    prompts = random_prompts([3, 4, 5, 7, 8, 9], seed=25)
    plain = _llm(checkpoint, num_kv_blocks=256, block_size=4)
    spec = _llm(checkpoint, num_kv_blocks=256, block_size=4, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    _scripted(spec, oracle, prompts)
    plain_tokens = _run_checking_blocks(plain.engine, prompts, GREEDY)
    spec_tokens = _run_checking_blocks(spec.engine, prompts, GREEDY)
    assert list(spec_tokens.values()) == list(plain_tokens.values())
    assert list(plain_tokens.values()) == [oracle.generate(p, MAX_TOKENS) for p in prompts]
    assert spec.engine.stats().spec_num_draft_tokens > spec.engine.stats().spec_num_accepted_tokens > 0
    # The same blocks were hashed into the prefix cache: none holds a rejected token.
    assert set(spec.engine.block_manager.cached_hashes()) == set(plain.engine.block_manager.cached_hashes())


def _stop_cases(reference: list[int]) -> list[SamplingParams]:
    # Cut inside runs: a stop id first produced at output index 6 (a proposal run covers 5..9), a max_tokens
    # that ends mid-run, and min_tokens that masks EOS and stop ids first.
    stop_id = reference[6]
    return [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=7, temperature=0.0),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop_id], min_tokens=12),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    ]


def test_stop_conditions_inside_an_accepted_run_cut_where_plain_decoding_does(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([11, 29], seed=26)
    plain = _llm(checkpoint, num_kv_blocks=128)
    spec = _llm(checkpoint, num_kv_blocks=128, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    unstopped = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        beyond = plain.generate([prompt], unstopped)[0].token_ids
        for params in _stop_cases(oracle.generate(prompt, MAX_TOKENS)):
            (want,) = plain.generate([prompt], params)
            # An always-right proposer that also knows the tokens past the stop (min_tokens changes the
            # path, so there it knows the stopped output only): every stop falls inside an accepted run.
            known = want.token_ids if params.min_tokens else beyond
            spec.engine.spec_decoder.proposer = ScriptedProposer({tuple(prompt): known}, set(), VOCAB_SIZE)
            (got,) = spec.generate([prompt], params)
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), params
            stats = got.spec_decode_stats
            assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    _assert_no_block_held(spec)


def _eos_case(plain: LLM) -> tuple[list[int], SamplingParams]:
    """A prompt and a logit bias towards EOS under which greedy decoding stops at EOS a few tokens in
    (the tiny checkpoints rarely choose it unbiased)."""
    for prompt in random_prompts([13] * 8, seed=27):
        for half_bias in range(1, 16):
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logit_bias={EOS_TOKEN_ID: half_bias / 2})
            (out,) = plain.generate([prompt], params)
            if out.finish_reason == "stop":
                if len(out.token_ids) >= 3:
                    return prompt, params
                break
    pytest.fail("no prompt and bias make this checkpoint stop at EOS a few tokens in")


def test_eos_inside_an_accepted_run_stops_there(checkpoint: Path) -> None:
    plain = _llm(checkpoint, num_kv_blocks=128)
    spec = _llm(checkpoint, num_kv_blocks=128, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    prompt, params = _eos_case(plain)
    (want,) = plain.generate([prompt], params)
    beyond = plain.generate([prompt], dataclasses.replace(params, ignore_eos=True))[0].token_ids
    assert beyond[: len(want.token_ids)] == want.token_ids and len(beyond) > len(want.token_ids)
    spec.engine.spec_decoder.proposer = ScriptedProposer({tuple(prompt): beyond}, set(), VOCAB_SIZE)
    (got,) = spec.generate([prompt], params)
    assert (got.token_ids, got.finish_reason) == (want.token_ids, "stop")
    assert got.token_ids[-1] == EOS_TOKEN_ID
    assert got.spec_decode_stats.num_accepted_tokens > 0


def test_request_with_use_speculation_false_never_verifies(checkpoint: Path, oracle: Oracle) -> None:
    prompts = _repetitive_prompts(seed=28)[:2]
    spec = _llm(checkpoint, num_kv_blocks=128, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    _scripted(spec, oracle, prompts)
    off = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, use_speculation=False)
    outputs = spec.generate(prompts, [off, GREEDY])
    _assert_matches_oracle(outputs, prompts, oracle)
    assert outputs[0].spec_decode_stats.num_drafts == 0
    assert outputs[1].spec_decode_stats.num_drafts > 0


def test_speculation_steps_aside_above_disable_by_batch_size(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([6, 12, 18], seed=29)
    spec = _llm(checkpoint, num_kv_blocks=128, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    proposer = _scripted(spec, oracle, prompts)
    engine = spec.engine
    short = SamplingParams(max_tokens=3, temperature=0.0)
    ids = [engine.add_request(p, params) for p, params in zip(prompts, [short, GREEDY, GREEDY])]
    while engine.has_unfinished_requests():
        in_engine = len(engine.scheduler.running) + engine.scheduler.num_waiting
        before = len(proposer.calls)
        outputs = {o.request_id: o for o in engine.step()}
        after_step = len(engine.scheduler.running) + engine.scheduler.num_waiting
        # Three requests: nobody proposes; once the short one is done, the other two do (while they
        # have more than one token to go).
        may_propose = any(s.params.max_tokens - s.num_output_tokens > 1 for s in engine.scheduler.running)
        assert (len(proposer.calls) > before) == (may_propose and after_step <= 2), (in_engine, after_step)
        for out in outputs.values():
            if out.request_id == ids[0]:
                assert out.spec_decode_stats.num_drafts == 0
    assert engine.stats().spec_num_drafts > 0


def test_imported_request_speculates_and_equals_transformers(checkpoint: Path, oracle: Oracle) -> None:
    prompts = _repetitive_prompts(seed=30)
    prefill = LLMEngine(_llm(checkpoint, num_kv_blocks=128).engine.config)
    decode = _llm(checkpoint, num_kv_blocks=128, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    _scripted(decode, oracle, prompts)
    tokens = handoff_tokens(prefill, decode.engine, prompts, GREEDY)
    assert list(tokens.values()) == [oracle.generate(p, MAX_TOKENS) for p in prompts]
    assert decode.engine.stats().spec_num_accepted_tokens > 0


def test_num_accepted_counts_the_leading_matches() -> None:
    assert SpecDecoder.num_accepted([4, 5, 6], [4, 5]) == 2
    assert SpecDecoder.num_accepted([4, 9, 6], [4, 5]) == 1
    assert SpecDecoder.num_accepted([3, 5, 6], [4, 5]) == 0
    assert SpecDecoder.num_accepted([3], []) == 0


@pytest.mark.parametrize("bad", [{"method": "eagle", "num_speculative_tokens": 2}, {"method": "ngram"}])
def test_llm_refuses_a_bad_speculative_config(llama_checkpoint: Path, bad: dict) -> None:
    with pytest.raises(ValueError, match="speculative_config"):
        _llm(llama_checkpoint, num_kv_blocks=16, speculative_config=bad)
