"""What real OpenAI clients send, through the official openai client: content parts, n choices, echo,
prompt logprobs, every sampling parameter (exact against the gRPC API and transformers), bad bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
import torch

from pdserve.gateway.server import GatewayServer
from pdserve.gateway.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import Oracle, StartInProcessCluster
from tests.http.test_openai_api import _client, _cluster
from tests.support.cluster import ClusterOptions
from tests.support.waiting import wait_until

PROMPT = list(range(10, 50))  # 40 tokens: two full blocks of 16 for the prefix cache
BLOCK = 16


async def _grpc(gateway: GatewayServer, prompt: list[int], **params: Any) -> list[generation_pb2.GenerateResponse]:
    """One call of the gateway's gRPC API: the reference the HTTP answers must equal."""
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(**params))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.server.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [response async for response in stub.Generate(request, timeout=60)]


@asynccontextmanager
async def _served(checkpoint: Path, tokenizer: object = None, **gateway_args: object
                  ) -> AsyncIterator[tuple[GatewayServer, openai.AsyncOpenAI]]:
    """The in-process cluster and an openai client of its HTTP API, both closed on exit."""
    async with _cluster(checkpoint, tokenizer, **gateway_args) as gateway, _client(gateway) as client:
        yield gateway, client


def _ids(logprobs: Any) -> list[int]:
    """Token ids from a tokenizer-less gateway's completions logprobs (vLLM's ``token_id:<id>``)."""
    return [int(token.removeprefix("token_id:")) for token in logprobs.tokens]


def _record_usages(gateway: GatewayServer) -> list[generation_pb2.Usage]:
    """Every servicer call's final usage, as the HTTP layer's calls finish."""
    usages: list[generation_pb2.Usage] = []
    generate = gateway.servicer.Generate

    async def recording(request: generation_pb2.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        stream = generate(request, context)
        try:
            async for response in stream:
                if response.HasField("usage"):
                    usages.append(response.usage)
                yield response
        finally:
            await stream.aclose()

    gateway.servicer.Generate = recording  # type: ignore[method-assign]
    return usages


@pytest.mark.asyncio
async def test_chat_content_parts_and_the_developer_role_render_like_plain_strings(chat_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(str(chat_checkpoint))
    as_parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "user", "content": "and then?"},
    ]
    as_strings = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello\nworld"},
                  {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    prompt = list(tokenizer.apply_chat_template(as_strings, add_generation_prompt=True, tokenize=True)["input_ids"])
    expected = Oracle(chat_checkpoint).generate(prompt, 6)
    async with _served(chat_checkpoint, tokenizer) as (gateway, client):
        answers = [await client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0.0,
                                                        logprobs=True)  # type: ignore[arg-type]
                   for messages in (as_parts, as_strings)]
        for answer in answers:
            assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
            content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
            assert [c.token for c in content] == [tokenizer.decode([t]) for t in expected]  # type: ignore[union-attr]
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content

        refused = [
            ([{"role": "user", "content": "hi"}, {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
             "messages[1].content[1].type", "'image_url' is not supported"),
            ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
             "messages[0].content[0].type", "'input_audio' is not supported"),
            ([{"role": "wizard", "content": "hi"}], "messages[0].role", "must be one of system, developer"),
        ]
        for messages, param, text in refused:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
            assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param
            assert text in caught.value.message


@pytest.mark.asyncio
async def test_greedy_n_gives_identical_choices_and_the_prompt_is_prefilled_once(llama_checkpoint: Path) -> None:
    expected = Oracle(llama_checkpoint).generate(PROMPT, 8)
    async with _served(llama_checkpoint) as (gateway, client):
        usages = _record_usages(gateway)
        single = await client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=0)
        usages.clear()  # the n=1 request filled the cache; a new prompt shows choice 0 computing it
        prompt = [p + 100 for p in PROMPT]
        expected_new = Oracle(llama_checkpoint).generate(prompt, 8)
        many = await client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=1,
                                               n=3, best_of=3)
        assert [c.index for c in many.choices] == [0, 1, 2]
        for choice in many.choices:
            assert _ids(choice.logprobs) == expected_new
            assert choice.finish_reason == ("length" if len(expected_new) == 8 else "stop")
            assert choice.logprobs is not None and all(len(top) == 1 for top in choice.logprobs.top_logprobs or [])
        assert _ids(single.choices[0].logprobs) == expected
        assert many.usage is not None
        assert (many.usage.prompt_tokens, many.usage.completion_tokens) == (40, 3 * len(expected_new))
        assert many.usage.total_tokens == 40 + 3 * len(expected_new)
        assert many.usage.prompt_tokens_details is not None and many.usage.prompt_tokens_details.cached_tokens == 0
        # Choice 0 computed the prompt; the others found its two full blocks in the prefix cache.
        assert sorted(u.cached_prompt_tokens for u in usages) == [0, 2 * BLOCK, 2 * BLOCK]
        assert many.choices[0].text == single.choices[0].text  # tokenizer-less: both empty, in step

        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="m", prompt=PROMPT, n=2, best_of=3)
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "best_of"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="m", prompt=PROMPT, n=17)
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "n"


class _IndexNotYetPublished:
    """The Redis index as the gateway sees it right after a prefill: the worker has not published the blocks yet."""

    async def longest_prefix(self, block_hashes: list[bytes], live: dict[str, int]) -> dict[str, int]:
        return {}


@pytest.mark.asyncio
async def test_with_two_prefill_workers_every_other_choice_goes_where_choice_0_left_the_prompt(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # Workers publish their blocks to Redis a moment after computing them. Even if the
    # index never catches up, the router remembers what it just had prefilled, so the
    # choices 1..n-1 go to choice 0's worker instead of alternating on the tie-break.
    options = ClusterOptions(num_kv_blocks=64, prefill_workers=2, http=True)
    gateway = (await start_inprocess_cluster(llama_checkpoint, options)).gateway
    assert gateway is not None
    gateway.router.lookup = _IndexNotYetPublished()  # type: ignore[assignment]
    usages = _record_usages(gateway)
    async with _client(gateway) as client:
        for offset in range(4):
            usages.clear()
            prompt = [(token * 7 + offset * 31) % 500 + 8 for token in range(40)]
            await client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0.0, n=4)
            assert sorted(u.cached_prompt_tokens for u in usages) == [0] + [2 * BLOCK] * 3, offset


@pytest.mark.asyncio
async def test_seeded_choices_are_reproducible_and_choice_i_samples_with_seed_plus_i(llama_checkpoint: Path) -> None:
    async with _served(llama_checkpoint) as (gateway, client):
        args: dict[str, Any] = dict(model="m", prompt=PROMPT, max_tokens=10, temperature=1.0, logprobs=0,
                                    extra_body={"ignore_eos": True})
        first = await client.completions.create(n=2, seed=5, **args)
        again = await client.completions.create(n=2, seed=5, **args)
        per_choice = [_ids(c.logprobs) for c in first.choices]
        assert [_ids(c.logprobs) for c in again.choices] == per_choice
        for index in range(2):
            alone = await client.completions.create(n=1, seed=5 + index, **args)
            assert _ids(alone.choices[0].logprobs) == per_choice[index]
            grpc_tokens = [t for r in await _grpc(gateway, PROMPT, max_tokens=10, temperature=1.0, seed=5 + index,
                                                 ignore_eos=True) for t in r.token_ids]
            assert grpc_tokens == per_choice[index]
        chat_like = await client.completions.create(n=2, seed=5, stream=True, **args)
        streamed: dict[int, list[int]] = {0: [], 1: []}
        async for chunk in chat_like:
            streamed[chunk.choices[0].index] += _ids(chunk.choices[0].logprobs)
        assert [streamed[0], streamed[1]] == per_choice


@pytest.mark.asyncio
async def test_streamed_choices_interleave_by_index_and_usage_counts_the_prompt_once(chat_checkpoint: Path) -> None:
    async with _served(chat_checkpoint, load_tokenizer(str(chat_checkpoint))) as (gateway, client):
        args: dict[str, Any] = dict(model="m", prompt=PROMPT, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
        whole = await client.completions.create(n=3, **args)
        assert len({c.text for c in whole.choices}) == 1 and whole.choices[0].text
        stream = await client.completions.create(n=3, stream=True, stream_options={
            "include_usage": True, "continuous_usage_stats": True}, **args)  # type: ignore[typeddict-unknown-key]
        chunks = [chunk async for chunk in stream]
        text_chunks, usage_chunk = chunks[:-1], chunks[-1]
        by_index: dict[int, list[Any]] = {}
        for chunk in text_chunks:
            assert len(chunk.choices) == 1
            by_index.setdefault(chunk.choices[0].index, []).append(chunk.choices[0])
        assert sorted(by_index) == [0, 1, 2]
        for index, pieces in by_index.items():
            assert "".join(p.text for p in pieces) == whole.choices[index].text
            assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + ["length"]
        running = [c.usage.completion_tokens for c in text_chunks]  # type: ignore[union-attr]
        assert running == sorted(running) and running[-1] == 24
        assert all(c.usage.prompt_tokens == 40 for c in text_chunks)  # type: ignore[union-attr]
        assert usage_chunk.choices == [] and usage_chunk.usage is not None
        assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (40, 24)
        assert whole.usage is not None and whole.usage.completion_tokens == 24

        chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2,
                                                    max_tokens=4, temperature=0.0, stream=True)
        roles: dict[int, list[str | None]] = {0: [], 1: []}
        async for chunk in chat:
            roles[chunk.choices[0].index].append(chunk.choices[0].delta.role)
        assert all(r[0] == "assistant" and len(r) >= 2 and r[1:] == [None] * (len(r) - 1) for r in roles.values())


@pytest.mark.asyncio
async def test_a_client_disconnect_cancels_every_choice(llama_checkpoint: Path) -> None:
    async with _served(llama_checkpoint) as (gateway, client):
        stream = await client.completions.create(model="m", prompt=PROMPT, max_tokens=500, temperature=0.0, n=3,
                                                 stream=True, extra_body={"ignore_eos": True})
        seen = set()
        async for chunk in stream:
            seen.add(chunk.choices[0].index)
            if len(seen) == 3:
                break
        assert gateway.servicer.admission.requests == 3
        await stream.close()
        await wait_until(lambda: gateway.servicer.admission.requests == 0, "every choice's admission slot freed")
        assert gateway.servicer.admission.requests == 0
        assert all(w.inflight_requests == 0 for w in gateway.pool.healthy("prefill") + gateway.pool.healthy("decode"))


@pytest.mark.asyncio
async def test_a_choice_refused_before_streaming_fails_the_request_and_cancels_the_others(llama_checkpoint: Path) -> None:
    async with _served(llama_checkpoint, max_inflight_requests=1) as (gateway, client):
        for stream in (False, True):
            # Choice 0 is admitted; choice 1 is over the limit: the request gets 429, and choice 0 is cancelled.
            with pytest.raises(openai.RateLimitError) as caught:
                await client.completions.create(model="m", prompt=PROMPT, max_tokens=900, n=2, stream=stream,
                                                extra_body={"ignore_eos": True})
            assert caught.value.status_code == 429 and "admission limit" in caught.value.message
            await wait_until(lambda: gateway.servicer.admission.requests == 0, "every choice's admission slot freed")
            assert gateway.servicer.admission.requests == 0
        registry = gateway.servicer.metrics.registry
        outcomes = {o: registry.get_sample_value("pdserve_requests_total", {"outcome": o})
                    for o in ("ok", "overloaded", "cancelled")}
        assert outcomes == {"ok": 0.0, "overloaded": 2.0, "cancelled": 2.0}  # each choice 0 was cancelled, not finished
        completion = await client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0.0)
        assert completion.usage is not None and completion.usage.prompt_tokens == len(PROMPT)


@pytest.mark.asyncio
async def test_echo_prepends_the_prompt_and_its_logprobs_equal_the_grpc_apis(chat_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(str(chat_checkpoint))
    prompt = "hello world, the cat sat on the mat"
    ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    model = Oracle(chat_checkpoint).model
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].log_softmax(-1)  # (len(ids), vocab)
    async with _served(chat_checkpoint, tokenizer) as (gateway, client):
        args: dict[str, Any] = dict(model="m", prompt=prompt, max_tokens=5, temperature=0.0)
        plain = await client.completions.create(logprobs=2, **args)
        echoed = await client.completions.create(echo=True, **args)
        assert echoed.choices[0].text == prompt + plain.choices[0].text
        assert echoed.usage is not None and echoed.usage.prompt_tokens == len(ids)

        scored = await client.completions.create(echo=True, logprobs=2, **args)
        lp, plain_lp = scored.choices[0].logprobs, plain.choices[0].logprobs
        assert lp is not None and plain_lp is not None and scored.choices[0].text == echoed.choices[0].text
        assert lp.tokens == [tokenizer.decode([t]) for t in ids] + plain_lp.tokens  # type: ignore[operator]
        first = (await _grpc(gateway, ids, max_tokens=5, temperature=0.0, prompt_logprobs=2))[0]
        assert [p.token_id for p in first.prompt_logprobs] == ids[1:]
        assert lp.token_logprobs == [None] + [p.logprob for p in first.prompt_logprobs] + plain_lp.token_logprobs  # type: ignore[operator]
        assert lp.top_logprobs == [None] + [
            {tokenizer.decode([t]): v for t, v in zip(p.top_token_ids, p.top_logprobs)} for p in first.prompt_logprobs
        ] + plain_lp.top_logprobs  # type: ignore[operator]
        assert lp.text_offset is not None and lp.text_offset[:2] == [0, len(tokenizer.decode([ids[0]]))]
        assert lp.text_offset[len(ids)] == len(prompt)  # the completion's text starts after the echoed prompt
        # ... and those are the model's own log-probabilities of the prompt's tokens.
        expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)

        two = await client.completions.create(echo=True, logprobs=2, n=2, **args)
        assert [c.text for c in two.choices] == [scored.choices[0].text] * 2
        assert [c.logprobs.tokens for c in two.choices] == [lp.tokens] * 2  # type: ignore[union-attr]

        stream = await client.completions.create(echo=True, logprobs=2, stream=True, **args)
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks) == scored.choices[0].text
        assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_vllm_prompt_logprobs_on_both_endpoints_equal_the_grpc_apis(chat_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(str(chat_checkpoint))
    async with _served(chat_checkpoint, tokenizer) as (gateway, client):
        completion = await client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0.0,
                                                     extra_body={"prompt_logprobs": 1})
        reference = (await _grpc(gateway, PROMPT, max_tokens=2, prompt_logprobs=1))[0].prompt_logprobs
        field = completion.choices[0].prompt_logprobs  # type: ignore[attr-defined]
        assert field[0] is None and len(field) == len(PROMPT)
        for entry, piece in zip(field[1:], reference):
            own = entry[str(piece.token_id)]
            assert own["logprob"] == piece.logprob and own["decoded_token"] == tokenizer.decode([piece.token_id])
            top = entry[str(piece.top_token_ids[0])]
            assert (top["logprob"], top["rank"]) == (piece.top_logprobs[0], 1)
            assert own["rank"] == (1 if piece.top_token_ids[0] == piece.token_id else None)

        messages = [{"role": "user", "content": "hello"}]
        chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        chat = await client.chat.completions.create(model="m", messages=messages, max_tokens=2,  # type: ignore[arg-type]
                                                    extra_body={"prompt_logprobs": 0})
        reference = (await _grpc(gateway, chat_ids, max_tokens=2, prompt_logprobs=0))[0].prompt_logprobs
        field = chat.prompt_logprobs  # type: ignore[attr-defined]
        assert field == [None] + [{str(p.token_id): {"logprob": p.logprob, "rank": None,
                                                     "decoded_token": tokenizer.decode([p.token_id])}}
                                  for p in reference]


@pytest.mark.asyncio
async def test_penalties_bias_and_vllm_extras_give_exactly_the_grpc_apis_tokens(llama_checkpoint: Path) -> None:
    prompt = [5, 6] * 20  # the tiny model's greedy answer repeats a token five times: penalties bite
    greedy = Oracle(llama_checkpoint).generate(prompt, 24)
    assert len(greedy) == 24 and greedy.count(290) == 5
    cases: list[dict[str, Any]] = [
        dict(presence_penalty=1.5, frequency_penalty=0.5),
        dict(frequency_penalty=2.0),
        dict(repetition_penalty=1.3),
        dict(stop_token_ids=[greedy[2]]),
        dict(min_tokens=12, stop_token_ids=[greedy[2]]),
        dict(logit_bias={greedy[0]: -100.0, 300: 5.0}),
        dict(top_k=3, temperature=1.0, seed=11),
    ]
    openai_names = ("presence_penalty", "frequency_penalty", "temperature", "seed", "logit_bias")
    async with _served(llama_checkpoint) as (gateway, client):
        for params in cases:
            completion = await client.completions.create(
                model="m", prompt=prompt, max_tokens=24, logprobs=0,
                temperature=params.get("temperature", 0.0), seed=params.get("seed"),
                presence_penalty=params.get("presence_penalty"), frequency_penalty=params.get("frequency_penalty"),
                logit_bias={str(k): v for k, v in params["logit_bias"].items()} if "logit_bias" in params else None,
                extra_body={k: v for k, v in params.items() if k not in openai_names})  # type: ignore[arg-type]
            expected = [t for r in await _grpc(gateway, prompt, max_tokens=24, **{"temperature": 0.0, **params})
                        for t in r.token_ids]
            assert _ids(completion.choices[0].logprobs) == expected, params
            if "temperature" not in params and params != dict(stop_token_ids=[greedy[2]]):
                assert expected != greedy, params  # the parameter did change the greedy tokens
        stopped = await client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0.0,
                                                  logprobs=0, extra_body={"stop_token_ids": [greedy[2]]})
        assert _ids(stopped.choices[0].logprobs) == greedy[:3] and stopped.choices[0].finish_reason == "stop"
        forced = await client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0.0, logprobs=0,
                                                  logit_bias={"300": 100})
        assert _ids(forced.choices[0].logprobs) == [300] * 6
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="m", prompt=prompt, logit_bias={"300": 101})
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "logit_bias"


@pytest.mark.asyncio
async def test_skip_special_tokens_false_writes_them_on_both_endpoints_and_a_non_boolean_is_refused(
    chat_checkpoint: Path,
) -> None:
    # The byte tokenizer's special tokens 5 and 6 (tests/http/conftest.py), which the grammar makes the model write.
    grammar = {"structured_outputs": {"grammar": 'start: <[5]> "hi" <[6]> "there"'}}
    messages = [{"role": "user", "content": "hello"}]
    async with _served(chat_checkpoint, load_tokenizer(str(chat_checkpoint))) as (_, client):
        for extra, text in [({}, "hithere"), ({"skip_special_tokens": True}, "hithere"),
                            ({"skip_special_tokens": None}, "hithere"),
                            ({"skip_special_tokens": False}, "<|reserved_0|>hi<|reserved_1|>there")]:
            completion = await client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0.0,
                                                         extra_body={**grammar, **extra})
            assert completion.choices[0].text == text, extra
            stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=16,  # type: ignore[arg-type]
                                                          temperature=0.0, stream=True, extra_body={**grammar, **extra})
            assert "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]) == text
        for bad in ("false", 0):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.completions.create(model="m", prompt=PROMPT, extra_body={"skip_special_tokens": bad})
            assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "skip_special_tokens"
            assert caught.value.body["message"] == f"skip_special_tokens must be a boolean, got {bad!r}"
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                                     extra_body={"skip_special_tokens": bad})
            assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "skip_special_tokens"


@pytest.mark.asyncio
async def test_parameters_are_honoured_or_refused_by_name_never_ignored(chat_checkpoint: Path) -> None:
    async with _served(chat_checkpoint, load_tokenizer(str(chat_checkpoint))) as (gateway, client):
        messages = [{"role": "user", "content": "hello"}]
        plain = await client.chat.completions.create(model="m", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                                     temperature=0.0)
        no_ops = await client.chat.completions.create(
            model="m", messages=messages, max_tokens=4, temperature=0.0, user="u1", metadata={"team": "a"},  # type: ignore[arg-type]
            store=False, service_tier="auto", response_format={"type": "text"}, tool_choice="none",
            modalities=["text"], parallel_tool_calls=False, prompt_cache_key="k", safety_identifier="s")
        assert no_ops.choices[0].message.content == plain.choices[0].message.content
        refused: list[tuple[dict[str, Any], str]] = [
            (dict(response_format={"type": "xml"}), "response_format.type"),
            (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
            (dict(tool_choice="auto"), "tool_choice"),
            (dict(reasoning_effort="low"), "reasoning_effort"),
            (dict(modalities=["text", "audio"]), "modalities"),
            (dict(store=True), "store"),
            (dict(extra_body={"min_p": 0.1}), "min_p"),
            (dict(extra_body={"guided_json": {"type": "strin"}}), "guided_json"),
        ]
        for args, param in refused:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", messages=messages, **args)  # type: ignore[arg-type]
            assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, args
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="m", prompt="x", suffix="tail")
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "suffix"


@pytest.mark.asyncio
async def test_bad_bodies_get_400_and_large_ones_413(llama_checkpoint: Path) -> None:
    async with _cluster(llama_checkpoint, http_max_body_bytes=64 * 1024) as gateway:
        url = f"http://127.0.0.1:{gateway.http_port}/v1/completions"
        bodies = [
            ("[" * 5000 + "]" * 5000, 400, "nested too deeply"),
            ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 413, "limit of 65536 bytes"),  # past the size limit first
            ('{"prompt": [1, 2], "max_tokens": ' + "9" * 5000 + "}", 400, "not valid JSON"),
            ("[1, 2]", 400, "must be a JSON object"),
            ('"text"', 400, "must be a JSON object"),
            ("{", 400, "not valid JSON"),
            (b'{"prompt": "\xff"}', 400, "not valid JSON"),
            ('{"prompt": [1, 2], "max_tokens": 2, "temperature": NaN}', 400, "temperature"),
            ('{"prompt": [1, 2], "max_tokens": 2, "' + "k" * 1000 + '": 1}', 400, "unknown parameter"),
            # Deep, but within what the parser takes: refused by the field's own check.
            ('{"prompt": [1, 2], "user": ' + "[" * 900 + "]" * 900 + "}", 400, "user may only be a string"),
            ('{"prompt": [1, 2], "n": ' + "[" * 900 + "]" * 900 + "}", 400, "n must be an integer"),
        ]
        async with aiohttp.ClientSession() as session:
            for body, status, text in bodies:
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
                    error = (await response.json())["error"]
                    assert (response.status, error["code"]) == (status, status), (body[:40], error)
                    assert text in error["message"], error
            # The gateway still serves.
            async with session.post(url, json={"prompt": [1, 2], "max_tokens": 2}) as response:
                assert response.status == 200 and json.loads(await response.text())["usage"]["prompt_tokens"] == 2
