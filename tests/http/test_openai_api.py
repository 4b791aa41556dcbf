"""The gateway's OpenAI-compatible HTTP API, driven by the official openai client against an in-process cluster."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import openai
import pytest

from pdserve.gateway.server import GatewayServer
from pdserve.service_common.server import ServerConfig
from tests.conftest import Oracle
from tests.support.cluster import ClusterOptions, InProcessCluster
from tests.support.waiting import wait_until

TOKEN = "s3cret-token"


@asynccontextmanager
async def _cluster(
    checkpoint: Path, tokenizer: object = None, auth_token: str | None = None, **gateway_args: object
) -> AsyncIterator[GatewayServer]:
    """Prefill, decode and a gateway with its HTTP API on an ephemeral port; all stopped on exit."""
    options = ClusterOptions(num_kv_blocks=64, http=True, tokenizer=tokenizer,
                             gateway_server=ServerConfig(auth_token=auth_token), gateway_args=gateway_args)
    async with InProcessCluster(checkpoint, options) as cluster:
        assert cluster.gateway is not None
        yield cluster.gateway


def _client(gateway: GatewayServer, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key=api_key, max_retries=0)


@pytest.mark.asyncio
async def test_completions_match_the_model_and_stream_with_usage(llama_checkpoint: Path) -> None:
    prompt = [1, 2, 3, 4, 5]
    expected = Oracle(llama_checkpoint).generate(prompt, 12)
    async with _cluster(llama_checkpoint) as gateway:
        client = _client(gateway)
        completion = await client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0.0)
        choice = completion.choices[0]
        assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
        assert completion.usage is not None
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (5, len(expected))
        assert completion.usage.total_tokens == 5 + len(expected)
        assert choice.finish_reason == ("length" if len(expected) == 12 else "stop")

        stream = await client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0.0, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]  # the client stops at data: [DONE]
        text_chunks, usage_chunk = chunks[:-1], chunks[-1]
        assert len(text_chunks) >= 2
        assert all(c.usage is None and len(c.choices) == 1 for c in text_chunks)
        assert [c.choices[0].finish_reason for c in text_chunks[:-1]] == [None] * (len(text_chunks) - 1)
        assert text_chunks[-1].choices[0].finish_reason == choice.finish_reason
        assert "".join(c.choices[0].text for c in text_chunks) == choice.text
        assert usage_chunk.choices == []
        assert usage_chunk.usage is not None and usage_chunk.usage.completion_tokens == len(expected)

        logprobs = await client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0.0, logprobs=2)
        lp = logprobs.choices[0].logprobs
        assert lp is not None and lp.tokens == [f"token_id:{t}" for t in expected[:3]]
        assert lp.top_logprobs is not None and all(len(top) == 2 for top in lp.top_logprobs)


@pytest.mark.asyncio
async def test_models_health_and_sse_wire_format(llama_checkpoint: Path) -> None:
    async with _cluster(llama_checkpoint) as gateway:
        models = await _client(gateway).models.list()
        assert [m.id for m in models.data] == [str(llama_checkpoint)]
        base = f"http://127.0.0.1:{gateway.http_port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/health") as response:
                assert response.status == 200
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "stream": True}
            async with session.post(f"{base}/v1/completions", json=body) as response:
                assert response.status == 200 and response.content_type == "text/event-stream"
                events = [line for line in (await response.text()).split("\n\n") if line]
            assert events[-1] == "data: [DONE]"
            assert all(e.startswith("data: {") for e in events[:-1])
            assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] in ("length", "stop")
            assert gateway.http_api is not None
            gateway.http_api.draining = True
            async with session.get(f"{base}/health") as response:
                assert response.status == 503


@pytest.mark.asyncio
async def test_bad_requests_get_400_with_the_field_named(llama_checkpoint: Path) -> None:
    async with _cluster(llama_checkpoint) as gateway:
        client = _client(gateway)
        cases = [
            (dict(prompt=[1, 2], max_tokens=4, top_p=2.0), "top_p"),
            (dict(prompt=[1, 2], max_tokens=4, n=17), "n"),
            (dict(prompt=[1, 2], max_tokens=0), "max_tokens"),
            (dict(prompt=[1, 600], max_tokens=4), "prompt"),
            (dict(prompt="text needs a tokenizer", max_tokens=4), "prompt"),
        ]
        for args, param in cases:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.completions.create(model="m", **args)  # type: ignore[arg-type]
            assert caught.value.status_code == 400
            body = caught.value.body
            assert isinstance(body, dict) and body["param"] == param and body["type"] == "invalid_request_error", body
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert "tokenizer" in caught.value.message
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "messages"


@pytest.mark.asyncio
async def test_a_wrong_api_key_gets_401_when_the_gateway_has_a_token(llama_checkpoint: Path) -> None:
    async with _cluster(llama_checkpoint, auth_token=TOKEN) as gateway:
        with pytest.raises(openai.AuthenticationError) as caught:
            await _client(gateway, "wrong").completions.create(model="m", prompt=[1, 2], max_tokens=2)
        assert caught.value.status_code == 401
        completion = await _client(gateway, TOKEN).completions.create(model="m", prompt=[1, 2], max_tokens=2)
        assert completion.usage is not None and completion.usage.prompt_tokens == 2


@pytest.mark.asyncio
async def test_over_the_admission_limit_gets_429_and_a_disconnect_frees_the_slot(llama_checkpoint: Path) -> None:
    async with _cluster(llama_checkpoint, max_inflight_requests=1) as gateway:
        client = _client(gateway)
        long = await client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=400, temperature=0.0,
                                               stream=True, extra_body={"ignore_eos": True})
        first = await anext(aiter(long))
        assert first.choices[0].text is not None
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(model="m", prompt=[4, 5], max_tokens=2)
        assert caught.value.status_code == 429 and "admission limit" in caught.value.message
        await long.close()  # the client goes away mid-stream: the gateway cancels the generation
        await wait_until(lambda: gateway.servicer.admission.requests == 0, "the admission slot to be freed")
        assert gateway.servicer.admission.requests == 0
        completion = await client.completions.create(model="m", prompt=[4, 5], max_tokens=2)
        assert completion.usage is not None and completion.usage.completion_tokens <= 2


@pytest.mark.slow
@pytest.mark.asyncio
async def test_chat_with_the_default_model_streams_and_answers() -> None:
    from pdserve.engine.default_model import ensure_default_model
    from pdserve.gateway.tokenizer import load_tokenizer

    path = ensure_default_model()
    async with _cluster(path, load_tokenizer(None)) as gateway:
        client = _client(gateway)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        answer = await client.chat.completions.create(model="m", messages=messages, max_completion_tokens=8,  # type: ignore[arg-type]
                                                      temperature=0.0, logprobs=True, top_logprobs=2)
        assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
        assert answer.usage is not None and answer.usage.completion_tokens <= 8
        assert answer.choices[0].logprobs is not None and answer.choices[0].logprobs.content is not None
        assert len(answer.choices[0].logprobs.content) == answer.usage.completion_tokens
        stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                      temperature=0.0, stream=True)
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content


@pytest.mark.asyncio
async def test_without_workers_health_and_completions_answer_503() -> None:
    from pdserve.gateway.server import GatewayServer

    # A gateway whose only worker addresses answer nothing: no healthy prefill or decode worker.
    gateway = GatewayServer(ServerConfig(), None, ["127.0.0.1:1"], ["127.0.0.1:1"], http_port=0)
    await gateway.start()
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            await _client(gateway).completions.create(model="pdserve", prompt=[1, 2, 3], max_tokens=2)
        assert caught.value.status_code == 503
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{gateway.http_port}/health") as response:
                assert response.status == 503
    finally:
        await gateway.stop()
