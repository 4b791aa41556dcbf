"""The OpenAI/vLLM sampling extras against transformers, float32 greedy, token for token.

repetition_penalty is transformers' ``RepetitionPenaltyLogitsProcessor``,
min_tokens its ``min_new_tokens``, logit_bias its ``sequence_bias`` with
single-token sequences; frequency and presence penalties, which transformers
lacks, are a ten-line logits processor written here from OpenAI's definition.
prompt_logprobs equal ``log_softmax`` of transformers' forward logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.types.handoff import KVHandoff
from pdserve.engine.types.hashing import hash_prompt_blocks
from tests.conftest import EOS_TOKEN_ID, MOE_FAMILIES, Oracle, family_of, preempting_pool, random_prompts

MAX_TOKENS = 20


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", **kwargs)


class _OutputPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties, over the generated tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_generate(oracle: Oracle, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers' greedy generate with the equivalents of ``params``' adjustments."""
    kwargs: dict[str, object] = {}
    if params.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = params.repetition_penalty
    if params.min_tokens:
        kwargs["min_new_tokens"] = params.min_tokens
    if params.logit_bias:
        kwargs["sequence_bias"] = [[[token_id], bias] for token_id, bias in params.logit_bias]
    processors = LogitsProcessorList()
    if params.frequency_penalty or params.presence_penalty:
        processors.append(_OutputPenalties(len(prompt), params.frequency_penalty, params.presence_penalty))
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = oracle.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=params.max_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=processors,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def hf_prompt_logprobs(oracle: Oracle, prompt: list[int]) -> torch.Tensor:
    """(len(prompt) - 1, vocab): log_softmax of the forward logits at every position but the last."""
    with torch.no_grad():
        logits = oracle.model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)[:-1]


def _greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, **kwargs})  # type: ignore[arg-type]


def test_repetition_penalty_equals_transformers_batched_with_plain_requests(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([3, 17, 40, 95, 23, 60], seed=21)
    params = [
        _greedy(repetition_penalty=1.8),
        _greedy(),
        _greedy(repetition_penalty=0.6),
        _greedy(),
        _greedy(repetition_penalty=3.0),
        _greedy(),
    ]
    outputs = _llm(checkpoint, num_kv_blocks=256).generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == hf_generate(oracle, prompt, p), p
    # The penalty changed what greedy decoding produces: the test can fail.
    assert outputs[0].token_ids != oracle.generate(prompts[0], MAX_TOKENS)


def test_min_tokens_holds_back_eos_exactly_as_transformers_min_new_tokens(checkpoint: Path, oracle: Oracle) -> None:
    # EOS biased far above everything else: without min_tokens it would be the first token.
    eager_eos = {EOS_TOKEN_ID: 40.0}
    prompts = random_prompts([5, 30, 64, 12], seed=22)
    params = [
        _greedy(logit_bias=eager_eos, min_tokens=6),
        _greedy(),
        _greedy(logit_bias=eager_eos),
        _greedy(logit_bias=eager_eos, min_tokens=13),
    ]
    outputs = _llm(checkpoint, num_kv_blocks=256).generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == hf_generate(oracle, prompt, p), p
    assert [len(out.token_ids) for out in (outputs[0], outputs[2], outputs[3])] == [7, 1, 14]
    assert [out.token_ids[-1] for out in (outputs[0], outputs[2], outputs[3])] == [EOS_TOKEN_ID] * 3
    assert [outputs[i].finish_reason for i in (0, 2, 3)] == ["stop"] * 3


def test_min_tokens_masks_stop_token_ids_too(checkpoint: Path) -> None:
    prompt = random_prompts([9], seed=23)[0]
    llm = _llm(checkpoint, num_kv_blocks=64)
    free = llm.generate(prompt, _greedy(ignore_eos=True))[0].token_ids
    stop_id = free[0]  # greedy's first token, made a stop id
    assert stop_id != free[1]
    stopped = llm.generate(prompt, _greedy(ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert (stopped.token_ids, stopped.finish_reason) == ([stop_id], "stop")
    held = llm.generate(prompt, _greedy(ignore_eos=True, stop_token_ids=[stop_id], min_tokens=1))[0]
    # Masked for the first token: the runner-up is chosen, as if the stop id's logit were -100 ...
    runner_up = llm.generate(prompt, _greedy(ignore_eos=True, logit_bias={stop_id: -100.0}, max_tokens=1))[0]
    assert held.token_ids[0] == runner_up.token_ids[0] != stop_id
    # ... and from the second token on the stop id ends the request again, as without min_tokens.
    rest = llm.generate(
        prompt + held.token_ids[:1], _greedy(ignore_eos=True, stop_token_ids=[stop_id], max_tokens=MAX_TOKENS - 1)
    )[0]
    assert (held.token_ids[1:], held.finish_reason) == (rest.token_ids, rest.finish_reason)


def test_logit_bias_equals_transformers_sequence_bias(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([4, 33, 70], seed=24)
    first_free = oracle.generate(prompts[0], MAX_TOKENS)[0]
    params = [
        _greedy(logit_bias={first_free: -100.0, 11: 2.5, 200: 3.25}),
        _greedy(logit_bias={5: 1.5, 300: -0.75, 301: 4.0}),
        _greedy(),
    ]
    outputs = _llm(checkpoint, num_kv_blocks=256).generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == hf_generate(oracle, prompt, p), p
    assert outputs[0].token_ids[0] != first_free


def test_frequency_and_presence_penalties_equal_their_definition(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([6, 25, 48], seed=25)
    params = [
        _greedy(frequency_penalty=1.5, ignore_eos=True),
        _greedy(presence_penalty=2.0, ignore_eos=True),
        _greedy(frequency_penalty=-0.5, presence_penalty=1.0, ignore_eos=True),
    ]
    outputs = _llm(checkpoint, num_kv_blocks=256).generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == hf_generate(oracle, prompt, p), p


def test_every_adjustment_at_once_chunked_and_batched_equals_transformers(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([120, 7, 64, 45], seed=26)
    combined = _greedy(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias={9: 1.0, 100: -2.0},
        min_tokens=4,
    )
    params = [combined, _greedy(), combined, _greedy(repetition_penalty=1.1)]
    # 32 tokens a step: the 120-token prompt is prefilled in four chunks while the others decode.
    outputs = _llm(checkpoint, num_kv_blocks=256, max_num_batched_tokens=32).generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == hf_generate(oracle, prompt, p), p


LOGPROB_RTOL = 4e-6  # ~32 float32 ulps


def _assert_prompt_logprobs_equal_transformers(
    entries: list, prompt: list[int], oracle: Oracle, num_top: int, atol: float = 1e-5
) -> None:
    expected = hf_prompt_logprobs(oracle, prompt)  # (len(prompt) - 1, vocab)
    assert [entry.token_id for entry in entries] == prompt[1:]
    got = torch.tensor([entry.logprob for entry in entries])
    own = expected.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    # Float32 sums in another order (chunks, the thread split a loaded machine gets) move a logprob
    # of -5 to -10 by tens of ulps (1e-5 is ~20 of them at -5): atol alone flaked at 1.0014e-5.
    torch.testing.assert_close(got, own, rtol=LOGPROB_RTOL, atol=atol)
    top_lps, top_ids = expected.topk(num_top, dim=-1) if num_top else (None, None)
    for position, entry in enumerate(entries):
        assert len(entry.top) == num_top
        if num_top:
            assert [token for token, _ in entry.top] == top_ids[position].tolist(), f"position {position}"
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in entry.top]), top_lps[position], rtol=LOGPROB_RTOL, atol=atol
            )


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 24], ids=["whole_prompt", "chunked"])
def test_prompt_logprobs_equal_transformers_log_softmax(
    checkpoint: Path, oracle: Oracle, max_num_batched_tokens: int
) -> None:
    prompts = random_prompts([1, 2, 17, 100, 40], seed=27)
    params = [
        _greedy(prompt_logprobs=3),
        _greedy(prompt_logprobs=0),
        _greedy(prompt_logprobs=5),
        _greedy(prompt_logprobs=2, logprobs=1),
        _greedy(),  # batched with one that does not ask
    ]
    llm = _llm(checkpoint, num_kv_blocks=256, max_num_batched_tokens=max_num_batched_tokens)
    outputs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == oracle.generate(prompt, MAX_TOKENS)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) - 1
            _assert_prompt_logprobs_equal_transformers(out.prompt_logprobs, prompt, oracle, p.prompt_logprobs)


def test_prompt_logprobs_compute_the_whole_prompt_when_its_prefix_is_cached(checkpoint: Path, oracle: Oracle) -> None:
    prompt = random_prompts([70], seed=28)[0]
    llm = _llm(checkpoint, num_kv_blocks=256, block_size=16)
    warm = llm.generate(prompt, _greedy())[0]
    again = llm.generate(prompt, _greedy())[0]
    assert (warm.num_cached_tokens, again.num_cached_tokens) == (0, 64)  # the prefix is cached
    with_logprobs = llm.generate(prompt, _greedy(prompt_logprobs=4))[0]
    assert with_logprobs.num_cached_tokens == 0
    assert with_logprobs.token_ids == warm.token_ids == oracle.generate(prompt, MAX_TOKENS)
    assert with_logprobs.prompt_logprobs is not None
    _assert_prompt_logprobs_equal_transformers(with_logprobs.prompt_logprobs, prompt, oracle, 4)
    # Its blocks were computed again, not leaked: the pool is whole once it finished.
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize(
    ("kwargs"),
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 64},
    ],
    ids=["preempted", "preempted_mid_prompt_chunks"],
)
def test_prompt_logprobs_survive_preemption_once(checkpoint: Path, oracle: Oracle, kwargs: dict[str, object]) -> None:
    # The pool of test_exactness's preemption tests: 21 blocks of 16 tokens (14 with sliding windows) for prompts
    # of 1 to 200 tokens.
    prompts = random_prompts([1, 5, 16, 17, 40, 95, 160, 200], seed=29)
    llm = _llm(checkpoint, num_kv_blocks=preempting_pool(checkpoint), block_size=16, **kwargs)
    outputs = llm.generate(prompts, _greedy(prompt_logprobs=1))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == oracle.generate(prompt, MAX_TOKENS)
        assert out.prompt_logprobs is not None
        # A prompt recomputed in other chunks sums in another order; through routed experts a logprob moved
        # 2.5e-5 (the tiny Mixtral on Zen 3, a top logprob of -2.17).
        atol = 5e-5 if family_of(checkpoint) in MOE_FAMILIES else 1e-5
        _assert_prompt_logprobs_equal_transformers(out.prompt_logprobs, prompt, oracle, 1, atol)


def test_prompt_logprobs_arrive_complete_on_the_first_output(llama_checkpoint: Path) -> None:
    engine = _llm(llama_checkpoint, num_kv_blocks=64, max_num_batched_tokens=16).engine
    prompt = random_prompts([50], seed=30)[0]
    engine.add_request(prompt, _greedy(prompt_logprobs=0, max_tokens=3), "r")
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    # Four prompt chunks produce no output; the first output is the first token's.
    assert [len(out.token_ids) for out in outputs] == [1, 2, 3]
    first = outputs[0].prompt_logprobs
    assert first is not None and [entry.token_id for entry in first] == prompt[1:]
    assert all(out.prompt_logprobs == first for out in outputs)


def test_continued_requests_do_not_compute_prompt_logprobs_again(llama_checkpoint: Path, oracle_llama: Oracle) -> None:
    """What a decode worker does when the KV never arrives: recompute the prompt, but report nothing twice."""
    engine: LLMEngine = _llm(llama_checkpoint, num_kv_blocks=64).engine
    prompt = random_prompts([40], seed=31)[0]
    expected = oracle_llama.generate(prompt, 8)
    params = _greedy(prompt_logprobs=2, max_tokens=8)
    handoff = KVHandoff(
        request_id="resumed", model_id=engine.model_id, layout=engine.kv_layout,
        block_hashes=tuple(hash_prompt_blocks(prompt, engine.block_size, engine.model_id)), num_tokens=len(prompt),
        first_token_id=expected[0], transport="grpc", address="127.0.0.1:1", lease_deadline_ms=0,
        worker_id="prefill-test", epoch=1,
    )
    engine.kv_connector.add_remote_request("resumed", prompt, params, handoff)
    assert [slot.first_block for slot in engine.kv_connector.drain_kv_slots()] == [0]
    first = engine.kv_connector.scheduler.recompute("resumed")
    assert first is not None and first.token_ids == expected[:1]
    outputs = [first]
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[-1].token_ids == expected
    assert all(out.prompt_logprobs is None for out in outputs)


@pytest.fixture
def oracle_llama(llama_checkpoint: Path) -> Oracle:
    return Oracle(llama_checkpoint)
