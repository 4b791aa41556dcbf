"""Penalties, logit_bias, min_tokens and prompt_logprobs through the gateway: exactly what ``LLM.generate`` gives.

Prefill samples the first token and computes the prompt's log-probabilities;
decode continues with the same adjustments (and the same random stream for a
seeded request); the prompt's log-probabilities reach the client once, on the
first response, whichever worker layout serves the request.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.types.outputs import RequestOutput
from pdserve.kv_transfer.descriptor import KVHandoff, KVLayout, handoff_to_proto
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.convert import sampling_params_from_proto, sampling_params_to_proto
from tests.conftest import EOS_TOKEN_ID, StartInProcessCluster, random_prompts
from tests.support.cluster import ClusterOptions

MAX_TOKENS = 12
FINISH_REASONS = {"stop": generation_pb2.FINISH_REASON_STOP, "length": generation_pb2.FINISH_REASON_LENGTH}

# Each request's parameters, as a client sends them: penalties, bias and prompt
# logprobs alone and together, greedy and seeded, next to a plain request.
REQUESTS = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=3, repetition_penalty=1.6, logprobs=2),
    SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        min_tokens=5,
        logit_bias={EOS_TOKEN_ID: 40.0, 12: -3.5},
        frequency_penalty=0.75,
        presence_penalty=0.5,
        prompt_logprobs=0,
    ),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=17, repetition_penalty=1.3, presence_penalty=1.0,
                   prompt_logprobs=1, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
]


def _request(prompt: list[int], params: SamplingParams) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=sampling_params_to_proto(params))


def _assert_same_as_offline(responses: list[generation_pb2.GenerateResponse], expected: RequestOutput) -> None:
    tokens = [token for response in responses for token in response.token_ids]
    assert tokens == expected.token_ids
    if expected.logprobs is not None:
        logprobs = [entry for response in responses for entry in response.logprobs]
        assert [entry.token_id for entry in logprobs] == tokens
        assert [list(entry.top_token_ids) for entry in logprobs] == [[t for t, _ in e.top] for e in expected.logprobs]
    # Once, on the first response.
    assert [len(response.prompt_logprobs) for response in responses[1:]] == [0] * (len(responses) - 1)
    got = responses[0].prompt_logprobs
    if expected.prompt_logprobs is None:
        assert len(got) == 0
        return
    want = expected.prompt_logprobs
    assert [entry.token_id for entry in got] == [entry.token_id for entry in want]
    assert [list(entry.top_token_ids) for entry in got] == [[t for t, _ in entry.top] for entry in want]
    # Float32 on the wire; the batch a prompt shared may round differently from the offline run.
    torch.testing.assert_close(
        torch.tensor([entry.logprob for entry in got]), torch.tensor([entry.logprob for entry in want]), rtol=0, atol=1e-5
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([30, 7, 52, 18], seed=61)


@pytest.fixture(scope="module")
def offline(llama_checkpoint: Path, prompts: list[list[int]]) -> list[RequestOutput]:
    outputs = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=128).generate(prompts, REQUESTS)
    # The adjustments are visible: min_tokens held the boosted EOS back exactly five tokens.
    assert outputs[1].token_ids[-1] == EOS_TOKEN_ID and len(outputs[1].token_ids) == 6
    return outputs


def test_every_new_field_survives_the_proto_round_trip() -> None:
    for params in REQUESTS + [SamplingParams()]:
        message = sampling_params_to_proto(params)
        assert sampling_params_from_proto(message) == params
    # Unset fields keep the engine's defaults.
    assert sampling_params_from_proto(generation_pb2.SamplingParams()) == SamplingParams()
    message = generation_pb2.SamplingParams(min_tokens=2, repetition_penalty=1.5, logit_bias={3: -1.0, 9: 2.0})
    assert sampling_params_from_proto(message) == SamplingParams(
        min_tokens=2, repetition_penalty=1.5, logit_bias=((3, -1.0), (9, 2.0))
    )


def test_skip_special_tokens_survives_the_proto_round_trip_and_unset_means_true() -> None:
    written = SamplingParams(max_tokens=4, skip_special_tokens=False)
    message = sampling_params_to_proto(written)
    assert message.HasField("skip_special_tokens") and message.skip_special_tokens is False
    assert sampling_params_from_proto(message) == written
    assert sampling_params_from_proto(generation_pb2.SamplingParams()).skip_special_tokens is True
    assert sampling_params_from_proto(generation_pb2.SamplingParams(skip_special_tokens=True)) == SamplingParams()


@pytest.mark.asyncio
async def test_prefill_and_decode_workers_give_what_llm_generate_gives(
    llama_checkpoint: Path, prompts: list[list[int]], offline: list[RequestOutput],
    start_inprocess_cluster: StartInProcessCluster,
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint)
    results = await asyncio.gather(
        *(cluster.generate(_request(prompt, params)) for prompt, params in zip(prompts, REQUESTS))
    )
    for responses, expected in zip(results, offline):
        _assert_same_as_offline(responses, expected)
    for report in await cluster.wait_idle():
        assert (report.num_running, report.num_free_blocks) == (0, report.num_total_blocks), report.role


@pytest.mark.asyncio
async def test_colocated_worker_gives_what_llm_generate_gives(
    llama_checkpoint: Path, prompts: list[list[int]], offline: list[RequestOutput],
    start_inprocess_cluster: StartInProcessCluster,
) -> None:
    options = ClusterOptions(prefill_workers=0, decode_workers=0, colocated_workers=1)
    cluster = await start_inprocess_cluster(llama_checkpoint, options)
    for prompt, params, expected in zip(prompts, REQUESTS, offline):
        responses = await cluster.generate(_request(prompt, params), timeout_s=30)
        _assert_same_as_offline(responses, expected)


@pytest.mark.asyncio
async def test_decode_recompute_after_a_failed_transfer_continues_the_adjustments(
    llama_checkpoint: Path, prompts: list[list[int]], offline: list[RequestOutput],
    start_inprocess_cluster: StartInProcessCluster,
) -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on: the prefill worker is gone
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    options = ClusterOptions(num_kv_blocks=64, prefill_workers=0, gateway=False)
    stub = (await start_inprocess_cluster(llama_checkpoint, options)).worker_stubs[0]
    for index in (0, 2):  # greedy with a penalty; seeded with penalties
        prompt, params, expected = prompts[index], REQUESTS[index], offline[index]
        handoff = KVHandoff(
            request_id=f"orphan-{index}", model_id=str(llama_checkpoint), layout=KVLayout(3, 2, 16, 16, "float32"),
            block_hashes=(), num_tokens=len(prompt), first_token_id=expected.token_ids[0], transport="grpc",
            address=dead, lease_deadline_ms=2**40, worker_id="gone", epoch=1,
        )
        request = worker_pb2.DecodeRequest(
            request_id=f"orphan-{index}", prompt_token_ids=prompt, handoff=handoff_to_proto(handoff),
            sampling_params=sampling_params_to_proto(params),
        )
        tokens = [t async for r in stub.Decode(request, timeout=30) for t in r.token_ids]  # type: ignore[union-attr]
        assert tokens == expected.token_ids[1:]
    report = await stub.Load(worker_pb2.LoadRequest(), timeout=5)
    assert (report.kv_recomputes, report.num_running, report.num_free_blocks) == (2, 0, 64)


@pytest.fixture(scope="module")
def worded_checkpoint(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a word-level tokenizer (token i is the word ``w<i>``), so stop strings work."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("tiny-llama-worded")
    shutil.copytree(llama_checkpoint, directory, dirs_exist_ok=True)
    words = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(512)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="w1", eos_token=f"w{EOS_TOKEN_ID}", pad_token="w0", unk_token="w0"
    ).save_pretrained(directory)
    return directory


@pytest.mark.asyncio
async def test_stop_strings_wait_for_min_tokens_across_prefill_and_decode(
    worded_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    prompt = random_prompts([21], seed=62)[0]
    llm = LLM(model=str(worded_checkpoint), dtype="float32", num_kv_blocks=64)
    free = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    stop = f"w{free.token_ids[0]}"  # the first token's text
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop])
    held = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=3)
    stopped, continued = llm.generate([prompt, prompt], [plain, held])
    # Without min_tokens the first token ends the request, its text cut; with it, the stop string
    # cannot end the request at the first (prefill) token nor at the second.
    assert (stopped.token_ids, stopped.text, stopped.finish_reason) == (free.token_ids[:1], "", "stop")
    assert len(continued.token_ids) >= 3 and continued.token_ids == free.token_ids[: len(continued.token_ids)]
    cluster = await start_inprocess_cluster(worded_checkpoint)
    for params, expected in ((plain, stopped), (held, continued)):
        responses = await cluster.generate(_request(prompt, params))
        tokens = [token for response in responses for token in response.token_ids]
        text = "".join(response.text for response in responses)
        assert (tokens, text) == (expected.token_ids, expected.text)
        assert responses[-1].finish_reason == FINISH_REASONS[expected.finish_reason]


@pytest.mark.asyncio
async def test_stop_strings_count_from_the_token_after_min_tokens(
    worded_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # vLLM's boundary: with min_tokens=k-1 a stop string completed by token k ends the request;
    # with min_tokens=k it does not. Offline and through the cluster alike.
    prompt = random_prompts([16], seed=63)[0]
    llm = LLM(model=str(worded_checkpoint), dtype="float32", num_kv_blocks=64)
    free = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    k = 4
    stop = f" w{free.token_ids[k - 1]}"  # token k's text, as the detokenizer appends it
    start = len(llm.tokenizer.decode(free.token_ids[: k - 1]))
    assert free.text.find(stop) == start  # token k is the first to complete it
    cases = []
    for min_tokens in (k - 1, k):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop],
                                min_tokens=min_tokens)
        cases.append((params, llm.generate(prompt, params)[0]))
    (_, at_k), (_, past_k) = cases
    assert (at_k.token_ids, at_k.text, at_k.finish_reason) == (free.token_ids[:k], free.text[:start], "stop")
    assert past_k.token_ids[: k + 1] == free.token_ids[: k + 1]
    cluster = await start_inprocess_cluster(worded_checkpoint)
    for params, expected in cases:
        responses = await cluster.generate(_request(prompt, params))
        tokens = [token for response in responses for token in response.token_ids]
        text = "".join(response.text for response in responses)
        assert (tokens, text) == (expected.token_ids, expected.text)
        assert responses[-1].finish_reason == FINISH_REASONS[expected.finish_reason]
