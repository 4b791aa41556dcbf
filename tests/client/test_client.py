"""pdserve.client against a gateway, prefill and decode server in this process (loopback ports, no Redis)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest

from pdserve.client import AsyncClient, Client, PdserveError, SamplingOptions, Usage
from pdserve_client.v1 import generation_pb2
from pdserve.engine import LLM, SamplingParams, StructuredOutputsParams
from pdserve.service_common.server import ServerConfig
from tests.conftest import Oracle, random_prompts
from tests.support.cluster import ClusterOptions, InProcessCluster

NUM_BLOCKS = 64
MAX_TOKENS = 12
GREEDY = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0)


def _cluster(path: Path, gateway_config: ServerConfig | None = None) -> InProcessCluster:
    """A cluster to run ``async with``; the client dials ``cluster.gateway_address``."""
    options = ClusterOptions(num_kv_blocks=NUM_BLOCKS, gateway_server=gateway_config or ServerConfig())
    return InProcessCluster(path, options)


def test_sampling_options_set_only_the_given_optional_fields() -> None:
    message = SamplingOptions(max_tokens=5, temperature=0.0, stop=("x",)).to_proto()
    assert message.max_tokens == 5 and message.HasField("temperature") and message.temperature == 0.0
    assert not message.HasField("top_p") and not message.HasField("seed") and not message.HasField("logprobs")
    assert list(message.stop) == ["x"]
    assert not message.HasField("min_tokens") and not message.HasField("prompt_logprobs") and not message.logit_bias
    message = SamplingOptions(repetition_penalty=1.5, logit_bias={3: -2.0}, prompt_logprobs=0).to_proto()
    assert message.repetition_penalty == 1.5 and dict(message.logit_bias) == {3: -2.0}
    assert message.HasField("prompt_logprobs") and message.prompt_logprobs == 0


def test_sampling_options_leave_skip_special_tokens_to_the_server_unless_given() -> None:
    assert not SamplingOptions().to_proto().HasField("skip_special_tokens")
    message = SamplingOptions(skip_special_tokens=False).to_proto()
    assert message.HasField("skip_special_tokens") and message.skip_special_tokens is False


def test_sampling_options_carry_use_speculation_and_structured_outputs_only_when_given() -> None:
    message = SamplingOptions().to_proto()
    assert not message.HasField("use_speculation") and not message.HasField("structured_outputs")
    choice = generation_pb2.StructuredOutput(choice=generation_pb2.Choices(choices=["yes", "no"]))
    message = SamplingOptions(use_speculation=False, structured_outputs=choice).to_proto()
    assert message.HasField("use_speculation") and message.use_speculation is False
    assert message.structured_outputs == choice and list(message.structured_outputs.choice.choices) == ["yes", "no"]


@pytest.mark.asyncio
async def test_structured_outputs_hold_the_output_to_a_choice_as_the_offline_engine_does(chat_checkpoint: Path) -> None:
    choices = ["cat", "dog", "bird"]
    options = SamplingOptions(max_tokens=8, temperature=0.0, structured_outputs=generation_pb2.StructuredOutput(
        choice=generation_pb2.Choices(choices=choices)))
    prompt = [1, 2, 3, 4]
    expected = LLM(model=str(chat_checkpoint), num_kv_blocks=NUM_BLOCKS).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(choice=choices)))[0]
    async with _cluster(chat_checkpoint) as cluster, AsyncClient(cluster.gateway_address, timeout=60) as client:
        completion = await client.generate(prompt, options)
    assert expected.text in choices
    assert (completion.text, completion.finish_reason) == (expected.text, "stop")


@pytest.mark.asyncio
async def test_skip_special_tokens_false_gives_the_special_tokens_text(chat_checkpoint: Path) -> None:
    # The bias makes the tiny model write the byte tokenizer's special token 5, <|reserved_0|> (tests/http/conftest.py).
    skipping = SamplingOptions(max_tokens=3, temperature=0.0, logit_bias={5: 100.0})
    writing = dataclasses.replace(skipping, skip_special_tokens=False)
    async with _cluster(chat_checkpoint) as cluster, AsyncClient(cluster.gateway_address, timeout=60) as client:
        written = await client.generate([1, 2, 3], writing)
        streamed = [chunk async for chunk in client.stream([1, 2, 3], writing)]
        skipped = await client.generate([1, 2, 3], skipping)
    assert written.token_ids == skipped.token_ids == (5, 5, 5)
    assert (written.text, skipped.text) == ("<|reserved_0|>" * 3, "")
    assert [chunk.text for chunk in streamed] == ["<|reserved_0|>"] * 3


@pytest.mark.asyncio
async def test_async_generate_equals_the_oracle_and_stream_concatenates_to_it(llama_checkpoint: Path) -> None:
    prompts = random_prompts([5, 17, 40], seed=50)
    oracle = Oracle(llama_checkpoint)
    async with _cluster(llama_checkpoint) as cluster, AsyncClient(cluster.gateway_address, timeout=60) as client:
        info = await client.model_info()
        assert (info.block_size, info.vocab_size, info.eos_token_ids) == (16, 512, (7,))
        for index, prompt in enumerate(prompts):
            expected = oracle.generate(prompt, MAX_TOKENS)
            completion = await client.generate(prompt, GREEDY, request_id=f"gen-{index}")
            assert list(completion.token_ids) == expected
            assert completion.request_id == f"gen-{index}"
            assert completion.finish_reason == ("length" if len(expected) == MAX_TOKENS else "stop")
            # First sight of this prompt: nothing in the prefill worker's prefix cache yet.
            assert completion.usage == Usage(
                prompt_tokens=len(prompt), completion_tokens=len(expected), cached_prompt_tokens=0
            )

            chunks = [chunk async for chunk in client.stream(prompt, GREEDY)]
            assert [token for chunk in chunks for token in chunk.token_ids] == expected
            assert "".join(chunk.text for chunk in chunks) == completion.text
            assert all(chunk.finish_reason is None and chunk.usage is None for chunk in chunks[:-1])
            assert chunks[-1].finish_reason == completion.finish_reason
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(expected)


@pytest.mark.asyncio
async def test_penalties_bias_and_prompt_logprobs_give_what_the_offline_engine_gives(llama_checkpoint: Path) -> None:
    prompt = random_prompts([21], seed=52)[0]
    extras = dict(min_tokens=4, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.4,
                  logit_bias={12: 2.5, 30: -4.0}, prompt_logprobs=2)
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=NUM_BLOCKS)
    expected = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **extras))[0]
    async with _cluster(llama_checkpoint) as cluster, AsyncClient(cluster.gateway_address, timeout=60) as client:
        options = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, **extras)
        completion = await client.generate(prompt, options)
        chunks = [chunk async for chunk in client.stream(prompt, options)]
    assert list(completion.token_ids) == expected.token_ids
    assert expected.prompt_logprobs is not None and len(expected.prompt_logprobs) == len(prompt) - 1
    got = completion.prompt_logprobs
    assert [entry.token_id for entry in got] == prompt[1:]
    assert [[t for t, _ in entry.top] for entry in got] == [[t for t, _ in entry.top] for entry in expected.prompt_logprobs]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got, expected.prompt_logprobs)) < 1e-5
    # Streamed: on the first chunk only.
    assert chunks[0].prompt_logprobs == got and all(not chunk.prompt_logprobs for chunk in chunks[1:])


@pytest.mark.asyncio
async def test_breaking_out_of_a_stream_cancels_the_request_on_the_decode_worker(llama_checkpoint: Path) -> None:
    long = SamplingOptions(max_tokens=1000, temperature=0.0, ignore_eos=True)
    async with _cluster(llama_checkpoint) as cluster, AsyncClient(cluster.gateway_address, timeout=60) as client:
        received = 0
        async for chunk in client.stream([1, 2, 3], long):
            received += len(chunk.token_ids)
            if received >= 3:  # past the prefill's first token: the decode worker is generating
                assert cluster.decode.runtime.async_engine.latest_stats.num_running == 1
                break
        await cluster.wait_idle()
        stats = cluster.decode.runtime.async_engine.latest_stats
        assert (stats.num_running, stats.num_free_blocks) == (0, NUM_BLOCKS)


@pytest.mark.asyncio
async def test_a_short_deadline_and_an_invalid_option_raise_pdserve_errors(llama_checkpoint: Path) -> None:
    async with _cluster(llama_checkpoint) as cluster, AsyncClient(cluster.gateway_address) as client:
        long = SamplingOptions(max_tokens=1000, temperature=0.0, ignore_eos=True)
        with pytest.raises(PdserveError) as caught:
            await client.generate([1, 2, 3], long, timeout=0.2)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

        with pytest.raises(PdserveError) as caught:
            await client.generate([1, 2, 3], SamplingOptions(top_p=1.5), timeout=30)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_p" in caught.value.message
        await cluster.wait_idle()
        assert cluster.decode.runtime.async_engine.latest_stats.num_running == 0


@pytest.mark.asyncio
async def test_blocking_client_generates_and_streams_like_the_async_client(llama_checkpoint: Path) -> None:
    prompt = random_prompts([23], seed=51)[0]
    expected = Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    async with _cluster(llama_checkpoint) as cluster:

        def blocking_calls() -> None:
            with Client(cluster.gateway_address, timeout=60) as client:
                assert client.model_info().vocab_size == 512
                completion = client.generate(prompt, GREEDY, request_id="blocking-1")
                assert list(completion.token_ids) == expected
                assert completion.request_id == "blocking-1"
                assert completion.usage.prompt_tokens == len(prompt)
                assert completion.usage.completion_tokens == len(expected)
                chunks = list(client.stream(prompt, GREEDY))
                assert [token for chunk in chunks for token in chunk.token_ids] == expected
                assert chunks[-1].finish_reason == completion.finish_reason
                with pytest.raises(PdserveError) as caught:
                    client.generate(prompt, SamplingOptions(max_tokens=0))
                assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert "max_tokens" in caught.value.message
                long = SamplingOptions(max_tokens=1000, temperature=0.0, ignore_eos=True)
                for received, _ in enumerate(client.stream([4, 5, 6], long), start=1):
                    if received == 3:
                        break  # the generator closes at once, cancelling the call

        await asyncio.to_thread(blocking_calls)
        await cluster.wait_idle()
        stats = cluster.decode.runtime.async_engine.latest_stats
        assert (stats.num_running, stats.num_free_blocks) == (0, NUM_BLOCKS)


@pytest.mark.asyncio
async def test_the_bearer_token_is_sent_as_authorization_metadata(llama_checkpoint: Path) -> None:
    async with _cluster(llama_checkpoint, ServerConfig(auth_token="s3cret-token")) as cluster:
        async with AsyncClient(cluster.gateway_address, timeout=30) as anonymous:
            with pytest.raises(PdserveError) as caught:
                await anonymous.model_info()
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        async with AsyncClient(cluster.gateway_address, auth_token="s3cret-token", timeout=30) as client:
            assert (await client.model_info()).vocab_size == 512
            assert len((await client.generate([1, 2, 3], GREEDY)).token_ids) >= 1

        def blocking_model_info() -> int:
            with Client(cluster.gateway_address, auth_token="s3cret-token", timeout=30) as blocking:
                return blocking.model_info().vocab_size

        assert await asyncio.to_thread(blocking_model_info) == 512
