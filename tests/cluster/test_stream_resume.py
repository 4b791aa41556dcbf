"""A stream resumed on another decode worker (``DecodeRequest.resume_token_ids``, what the gateway sends when a
stream's worker fails mid-stream): the worker computes the prompt and the tokens already sent, and streams exactly
what the undisturbed request streams after them: tokens, text (incomplete characters and partial stop-string
matches included), logprobs, a grammar's constraint, a seeded draw, the finish."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from pdserve.gateway.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from tests.conftest import random_prompts
from tests.support.cluster import ClusterOptions, InProcessCluster


def _joined(pieces: list) -> tuple[list[int], str, list[tuple[int, float]]]:
    tokens = [t for p in pieces for t in p.token_ids]
    text = "".join(p.text for p in pieces)
    logprobs = [(entry.token_id, entry.logprob) for p in pieces for entry in p.logprobs]
    return tokens, text, logprobs


@pytest.mark.asyncio
async def test_a_resumed_stream_continues_exactly_as_the_undisturbed_one(chat_checkpoint: Path) -> None:
    options = ClusterOptions(num_kv_blocks=128, tokenizer=load_tokenizer(str(chat_checkpoint)))
    prompt = random_prompts([37], seed=96)[0]
    cases = {
        "greedy with logprobs": generation_pb2.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                              logprobs=2),
        "seeded": generation_pb2.SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True),
        "regex": generation_pb2.SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_outputs=
                                               generation_pb2.StructuredOutput(regex=r"([a-z]{3} ){4,9}[a-z]+\.")),
    }
    async with InProcessCluster(chat_checkpoint, options) as cluster:
        decode = cluster.worker_stubs[1]
        for name, params in cases.items():
            request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)
            whole = await cluster.generate(request)
            tokens, text, logprobs = _joined(whole)
            for cut in (1, 5, 17):
                resumed = [piece async for piece in decode.Decode(worker_pb2.DecodeRequest(
                    request_id=f"resume-{cut}", prompt_token_ids=prompt, sampling_params=params,
                    resume_token_ids=tokens[:cut]), timeout=30)]
                sent = _joined_prefix(whole, cut)
                rest_tokens, rest_text, rest_logprobs = _joined(resumed)
                assert tokens[:cut] + rest_tokens == tokens, (name, cut)
                assert sent[1] + rest_text == text, (name, cut)
                # The same tokens; values to float32 rounding (a position computed in a prefill, not a decode step).
                resumed_logprobs = sent[2] + rest_logprobs
                assert [t for t, _ in resumed_logprobs] == [t for t, _ in logprobs], (name, cut)
                assert [v for _, v in resumed_logprobs] == pytest.approx([v for _, v in logprobs], abs=1e-5)
                assert resumed[-1].finish_reason == whole[-1].finish_reason, (name, cut)
            if name == "greedy with logprobs":
                # A stop string that straddles a cut: matched where the undisturbed stream matched it.
                stop = text[6:9]
                stopped = await cluster.generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=prompt, sampling_params=_with_stop(params, stop)))
                stop_tokens, stop_text, _ = _joined(stopped)
                assert stop_text == text[:6]
                for cut in range(1, len(stop_tokens)):
                    resumed = [piece async for piece in decode.Decode(worker_pb2.DecodeRequest(
                        request_id=f"stop-{cut}", prompt_token_ids=prompt, sampling_params=_with_stop(params, stop),
                        resume_token_ids=stop_tokens[:cut]), timeout=30)]
                    assert stop_tokens[:cut] + _joined(resumed)[0] == stop_tokens, cut
                    assert _joined_prefix(stopped, cut)[1] + _joined(resumed)[1] == stop_text, cut
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _drain(decode.Decode(worker_pb2.DecodeRequest(
                request_id="too-many", prompt_token_ids=prompt, sampling_params=cases["seeded"],
                resume_token_ids=[5] * 40), timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "resume_token_ids holds 40 tokens: nothing is left of max_tokens (40)"
        await cluster.wait_idle()


@pytest.mark.asyncio
async def test_skip_special_tokens_false_holds_on_prefill_decode_and_a_resumed_stream(chat_checkpoint: Path) -> None:
    """The parameter travels with the request: the prefill worker writes the first token (a special one), the decode
    worker the rest, and the Decode the gateway sends when the stream moves (``resume_request``) keeps writing them."""
    from pdserve.gateway.migration import resume_request

    options = ClusterOptions(num_kv_blocks=128, tokenizer=load_tokenizer(str(chat_checkpoint)))
    prompt = random_prompts([29], seed=97)[0]
    # The byte tokenizer's special tokens 5 and 6 (tests/http/conftest.py), which the grammar makes the model write.
    grammar = generation_pb2.StructuredOutput(grammar='start: <[5]> "hi" <[6]> "there"')
    written = generation_pb2.SamplingParams(max_tokens=16, temperature=0.0, skip_special_tokens=False,
                                            structured_outputs=grammar)
    skipped = generation_pb2.SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=grammar)
    async with InProcessCluster(chat_checkpoint, options) as cluster:
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=written)
        whole = await cluster.generate(request)
        tokens, text, _ = _joined(whole)
        assert (list(whole[0].token_ids), whole[0].text) == ([5], "<|reserved_0|>")
        assert text == "<|reserved_0|>hi<|reserved_1|>there"
        default = await cluster.generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt,
                                                                         sampling_params=skipped))
        assert _joined(default)[:2] == (tokens, "hithere")
        for cut in range(1, len(tokens)):
            resumed = [piece async for piece in cluster.worker_stubs[1].Decode(
                resume_request(request, f"moved-{cut}", prompt, tokens[:cut], None), timeout=30)]
            rest_tokens, rest_text, _ = _joined(resumed)
            assert tokens[:cut] + rest_tokens == tokens, cut
            assert _joined_prefix(whole, cut)[1] + rest_text == text, cut
        await cluster.wait_idle()


def _joined_prefix(pieces: list, num_tokens: int) -> tuple[list[int], str, list[tuple[int, float]]]:
    """What the client had received when ``num_tokens`` tokens had come (the pieces here hold one token each)."""
    assert all(len(p.token_ids) <= 1 for p in pieces)
    return _joined([p for p in pieces if p.token_ids][:num_tokens])


def _with_stop(params: generation_pb2.SamplingParams, stop: str) -> generation_pb2.SamplingParams:
    copy = generation_pb2.SamplingParams()
    copy.CopyFrom(params)
    copy.stop.append(stop)
    return copy


async def _drain(call) -> None:  # noqa: ANN001
    async for _ in call:
        pass
