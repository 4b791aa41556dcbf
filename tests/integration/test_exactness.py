"""Greedy float32 output equals transformers' generate, token for token, through every engine path."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine import LLM, LLMEngine, SamplingParams
from tests.conftest import FAMILY_CONFIGS, Oracle, build_checkpoint, preempting_pool, random_prompts
from tests.support.handoff import hand_over, handoff_tokens, prefill_and_hold

# Mixed lengths from 1 to 300 tokens, around block boundaries (block size 16) too.
PROMPT_LENGTHS = [1, 5, 16, 17, 40, 95, 160, 300]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", **kwargs)


def _assert_matches_oracle(outputs: list, prompts: list[list[int]], oracle: Oracle) -> None:
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == oracle.generate(prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


def _assert_no_block_held(llm: LLM) -> None:
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.held_block_ids() == []


def test_batched_greedy_equals_transformers(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    llm = _llm(checkpoint, num_kv_blocks=256)
    # On CPU in float32, decodes go through the C kernel (this machine has a compiler).
    assert llm.engine.runner.backend.name == "cpu_paged"
    outputs = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(outputs, prompts, oracle)
    assert [o.finish_reason for o in outputs] == [
        "stop" if o.token_ids[-1] == 7 and len(o.token_ids) < MAX_TOKENS else "length" for o in outputs
    ]
    _assert_no_block_held(llm)


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def drawn_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A family's tiny checkpoint with its projection biases and norm weights drawn, and the same one without.

    transformers starts every bias at zero and every norm weight at its identity, so on the shared fixtures a
    path that dropped a bias (Qwen2's q/k/v) or a norm's weight (Qwen3's q/k norms, Gemma's sandwich norms)
    would still agree with it."""
    family = request.param
    drawn = build_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}-"), FAMILY_CONFIGS[family](),
                             draw_biases_and_norms=True)
    plain = build_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}-"), FAMILY_CONFIGS[family]())
    return drawn, plain


def test_drawn_biases_and_norm_weights_equal_transformers(drawn_checkpoint: tuple[Path, Path]) -> None:
    drawn, plain = drawn_checkpoint
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    oracle = Oracle(drawn)
    # Batched (decodes through the C kernel), and in 12-token chunks over the cache through SDPA.
    for options in ({}, {"max_num_batched_tokens": 12, "attention_backend": "sdpa"}):
        _assert_matches_oracle(_llm(drawn, num_kv_blocks=256, **options).generate(prompts, GREEDY), prompts, oracle)
    # The drawn values decide tokens: the same weights without them answer otherwise.
    plain_outputs = _llm(plain, num_kv_blocks=256).generate(prompts, GREEDY)
    assert any(out.token_ids != oracle.generate(prompt, MAX_TOKENS) for prompt, out in zip(prompts, plain_outputs))


def test_chunked_prefill_under_small_token_budget_equals_transformers(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    # 32 tokens per step: the 300-token prompt takes ten chunks, mixed with decodes.
    llm = _llm(checkpoint, num_kv_blocks=256, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(outputs, prompts, oracle)
    _assert_no_block_held(llm)


def test_short_chunks_through_the_kernel_equal_transformers(checkpoint: Path, oracle: Oracle) -> None:
    # 12 tokens per step: every chunk after a prompt's first is a short query over a cached
    # context, which the C kernel attends (the shape a speculative step's verification has).
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    llm = _llm(checkpoint, num_kv_blocks=256, max_num_batched_tokens=12)
    backend = llm.engine.runner.backend
    kernel_query_lens: set[int] = set()
    build_metadata = backend.build_metadata

    def recording_build_metadata(batch: object) -> object:
        metadata = build_metadata(batch)
        if metadata.kernel_plan is not None:
            kernel_query_lens.update(metadata.kernel_plan.query_lens.tolist())
        return metadata

    backend.build_metadata = recording_build_metadata
    outputs = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(outputs, prompts, oracle)
    assert 1 in kernel_query_lens and max(kernel_query_lens) == 12
    _assert_no_block_held(llm)


def test_sdpa_backend_equals_transformers(checkpoint: Path, oracle: Oracle) -> None:
    # The pure-torch path that machines without a C compiler (and GPUs without flash-attn) take.
    prompts = random_prompts(PROMPT_LENGTHS, seed=13)
    llm = _llm(checkpoint, num_kv_blocks=256, max_num_batched_tokens=64, attention_backend="sdpa")
    assert llm.engine.runner.backend.name == "sdpa"
    outputs = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(outputs, prompts, oracle)
    _assert_no_block_held(llm)


def test_prefix_cache_hits_equal_transformers(checkpoint: Path, oracle: Oracle) -> None:
    shared = random_prompts([70], seed=3)[0]
    suffixes = random_prompts([1, 9, 16, 30, 50, 3, 17, 120], seed=4)
    prompts = [shared + suffix for suffix in suffixes]
    llm = _llm(checkpoint, num_kv_blocks=512, block_size=16)
    first = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(first, prompts, oracle)
    # All admitted in one step: nothing was cached yet when they started.
    assert [o.num_cached_tokens for o in first] == [0] * len(prompts)

    second = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(second, prompts, oracle)
    # Every full prompt block is now cached, except that one token is always computed.
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 16 * 16 for p in prompts]

    # A new prompt with the shared prefix hits the shared prefix's 4 full blocks.
    new_prompt = shared + random_prompts([11], seed=5)[0]
    (third,) = llm.generate([new_prompt], GREEDY)
    assert third.num_cached_tokens == 64
    assert third.token_ids == oracle.generate(new_prompt, MAX_TOKENS)
    _assert_no_block_held(llm)


def test_preemption_by_tiny_pool_equals_transformers(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([1, 5, 16, 17, 40, 95, 160, 200], seed=6)
    # 21 blocks of 16 tokens: the first six prompts fill 14 at admission, then
    # their decodes need 8 more, so the newest running sequence is preempted.
    llm = _llm(checkpoint, num_kv_blocks=preempting_pool(checkpoint), block_size=16, enable_prefix_caching=False)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_matches_oracle(outputs, prompts, oracle)
    _assert_no_block_held(llm)


def test_preemption_with_prefix_caching_equals_transformers(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([1, 5, 16, 17, 40, 95, 160, 200], seed=7)
    llm = _llm(checkpoint, num_kv_blocks=21, block_size=16, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_matches_oracle(outputs, prompts, oracle)
    _assert_no_block_held(llm)


def test_requests_added_mid_run_equal_transformers(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=8)
    llm = _llm(checkpoint, num_kv_blocks=256, max_num_batched_tokens=128)
    engine: LLMEngine = llm.engine
    finished: dict[str, list[int]] = {}
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    steps = 0
    pending = list(prompts[3:])
    while engine.has_unfinished_requests() or pending:
        # One new request every third step, while others are mid-prefill or decoding.
        if pending and steps % 3 == 0:
            ids.append(engine.add_request(pending.pop(0), GREEDY))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        steps += 1
    for request_id, prompt in zip(ids, prompts):
        assert finished[request_id] == oracle.generate(prompt, MAX_TOKENS)
    _assert_no_block_held(llm)


def test_abort_frees_blocks_at_once(llama_checkpoint: Path) -> None:
    llm = _llm(llama_checkpoint, num_kv_blocks=64)
    engine = llm.engine
    prompts = random_prompts([40, 100], seed=9)
    a = engine.add_request(prompts[0], GREEDY)
    b = engine.add_request(prompts[1], GREEDY)
    engine.step()
    assert engine.block_manager.num_used_blocks == 3 + 7
    out = engine.abort_request(a)
    assert out is not None and out.finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 7
    engine.abort_request(b)
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.abort_request("unknown") is None


def test_kv_export_import_between_engines_equals_transformers(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([1, 16, 37, 150], seed=10)
    prefill = _llm(checkpoint, num_kv_blocks=64).engine
    decode = _llm(checkpoint, num_kv_blocks=64).engine
    outputs = handoff_tokens(prefill, decode, prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        assert outputs[f"req-{i}"] == oracle.generate(prompt, MAX_TOKENS)


def test_kv_import_copies_only_blocks_the_decoder_lacks(llama_checkpoint: Path) -> None:
    prefill = _llm(llama_checkpoint, num_kv_blocks=64).engine
    decode = _llm(llama_checkpoint, num_kv_blocks=64).engine
    prompt = random_prompts([70], seed=11)[0]
    # The decoder computes the same prompt itself first, caching its 4 full blocks.
    decode.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while decode.has_unfinished_requests():
        decode.step()
    held = prefill_and_hold(prefill, prompt, GREEDY)
    assert held.kv_handoff is not None and len(held.kv_handoff.block_hashes) == 4
    decode.kv_connector.add_remote_request("moved", prompt, GREEDY, held.kv_handoff)
    (slot,) = decode.kv_connector.drain_kv_slots()
    # Blocks are allocated before anything moves: the 4 cached ones are shared, only the partial fifth travels.
    assert slot.first_block == 4
    blocks = prefill.leases.export(held.request_id, slot.first_block)
    assert blocks.shape[2] == 1
    assert decode.kv_connector.fill("moved", slot.first_block, blocks) is not None


def test_seeded_sampling_continues_the_same_stream_across_a_kv_handoff(llama_checkpoint: Path) -> None:
    prompt = random_prompts([37], seed=12)[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=77, ignore_eos=True)
    (reference,) = _llm(llama_checkpoint, num_kv_blocks=64).generate([prompt], params)
    prefill = _llm(llama_checkpoint, num_kv_blocks=64).engine
    decode = _llm(llama_checkpoint, num_kv_blocks=64).engine
    hand_over(prefill, decode, prompt, params)
    tokens: list[int] = []
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens = out.token_ids
    # The decode side skips the draw the prefill side made for the first token.
    assert tokens == reference.token_ids
