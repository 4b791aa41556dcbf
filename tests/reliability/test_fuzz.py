"""Random GenerateRequests against an in-process cluster: a valid stream or a client error, never a hang or a leak."""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdserve.gateway.validation import RequestLimits, validate_generate_request
from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import VOCAB_SIZE
from tests.support.cluster import NUM_KV_BLOCKS, InProcessCluster

MAX_CONTEXT = 1024
CALL_TIMEOUT_S = 20.0
ALLOWED_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
LIMITS = RequestLimits().for_model(vocab_size=VOCAB_SIZE, max_context_length=MAX_CONTEXT)

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)  # subnormals and -0.0 included
VALID_TOKEN_ID = st.integers(0, VOCAB_SIZE - 1)
ANY_TOKEN_ID = st.integers(0, 2**32 - 1)

# Each field is usually unset or valid, sometimes extreme: enough valid requests to exercise the
# stream, and valid max_tokens stay small so the run stays short (invalid ones may be huge).
SAMPLING_PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.one_of(st.integers(1, 4), INT32),
        "temperature": st.one_of(st.sampled_from([0.0, 0.7, 1.0]), st.floats(0.0, 10.0), ANY_FLOAT),
        "top_p": st.one_of(st.floats(0.0, 1.0, exclude_min=True), ANY_FLOAT),
        "top_k": st.one_of(st.integers(-1, VOCAB_SIZE + 10), INT32),
        "seed": st.one_of(st.integers(0, 2**63 - 1), INT64),
        "stop": st.lists(st.text(max_size=300), max_size=20),
        "stop_token_ids": st.one_of(st.lists(VALID_TOKEN_ID, max_size=4), st.lists(ANY_TOKEN_ID, max_size=300)),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.integers(0, 25), INT32),
        "min_tokens": st.one_of(st.integers(0, 4), INT32),
        "presence_penalty": st.one_of(st.floats(-2.0, 2.0), ANY_FLOAT),
        "frequency_penalty": st.one_of(st.floats(-2.0, 2.0), ANY_FLOAT),
        "repetition_penalty": st.one_of(st.floats(0.0, 10.0, exclude_min=True), ANY_FLOAT),
        "logit_bias": st.dictionaries(
            st.one_of(VALID_TOKEN_ID, ANY_TOKEN_ID),
            st.one_of(st.floats(-100.0, 100.0, width=32), st.floats(width=32)),
            max_size=8,
        ),
        "prompt_logprobs": st.one_of(st.integers(0, 25), INT32),
    },
)
PROMPT_TOKEN_IDS = st.one_of(
    st.lists(VALID_TOKEN_ID, max_size=48),
    st.lists(ANY_TOKEN_ID, max_size=48),
    # Around the context limit.
    st.integers(MAX_CONTEXT - 20, MAX_CONTEXT + 8).map(lambda n: [5] * n),
)
REQUEST = st.fixed_dictionaries(
    {"prompt_token_ids": PROMPT_TOKEN_IDS, "sampling_params": SAMPLING_PARAMS},
    optional={
        "prompt": st.text(max_size=2000),
        "request_id": st.one_of(
            st.from_regex(r"[A-Za-z0-9_.:-]{1,40}", fullmatch=True),
            st.text(max_size=40),
            st.text(min_size=250, max_size=300),
        ),
    },
)

# Suffixes that keep request ids unique: a client-chosen id reused while its KV is still
# held leaks blocks (the xfail in test_bad_input), which would fail the final check here.
_request_numbers = itertools.count()


def _build(fields: dict) -> generation_pb2.GenerateRequest:
    fields = dict(fields)
    params = fields.pop("sampling_params")
    if fields.get("request_id"):
        fields["request_id"] += f"#{next(_request_numbers)}"
    return generation_pb2.GenerateRequest(sampling_params=generation_pb2.SamplingParams(**params), **fields)


def _gateway_error(request: generation_pb2.GenerateRequest) -> str | None:
    """What the gateway's validation says (None: it passes), knowing the gateway has no tokenizer."""
    token_ids = list(request.prompt_token_ids) if request.prompt_token_ids else (None if request.prompt else [])
    try:
        validate_generate_request(request, token_ids, LIMITS)
    except ValueError as error:
        return str(error)
    return None


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(llama_checkpoint: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(llama_checkpoint) as cluster:
        yield cluster


@pytest.mark.asyncio(loop_scope="module")
@settings(
    max_examples=100,
    deadline=None,
    database=None,  # no .hypothesis folder in the working tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fields=REQUEST)
async def test_random_request_gets_a_valid_stream_or_a_client_error(cluster: InProcessCluster, fields: dict) -> None:
    request = _build(fields)
    expected_error = _gateway_error(request)
    try:
        responses = await cluster.generate(request, timeout_s=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        event(f"{error.code().name}: {(error.details() or '').split(' ')[0]}")  # see --hypothesis-show-statistics
        assert error.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the call hung"
        assert error.code() in ALLOWED_ERRORS, (error.code(), error.details())
        if expected_error is not None:
            assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, expected_error)
        else:
            # The one rejection the gateway leaves to the worker: its engine has no tokenizer for stop strings.
            assert request.sampling_params.stop, error.details()
            assert error.details() == "stop strings need a tokenizer, and this checkpoint has none"
        return

    event("served")
    assert expected_error is None, f"served a request the gateway should refuse: {expected_error}"
    params = request.sampling_params
    max_tokens = params.max_tokens if params.HasField("max_tokens") else 16
    *pieces, last = responses
    assert all(piece.finish_reason == generation_pb2.FINISH_REASON_UNSPECIFIED for piece in pieces)
    assert last.finish_reason in (generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH)
    assert last.HasField("usage")
    tokens = [token for response in responses for token in response.token_ids]
    assert all(0 <= token < VOCAB_SIZE for token in tokens)
    assert 1 <= len(tokens) <= max_tokens
    assert last.usage.completion_tokens == len(tokens)
    assert last.usage.prompt_tokens == len(request.prompt_token_ids)
    if last.finish_reason == generation_pb2.FINISH_REASON_LENGTH:
        assert len(tokens) == max_tokens
    if request.request_id:
        assert {response.request_id for response in responses} == {request.request_id}
    if params.HasField("logprobs"):
        entries = [entry for response in responses for entry in response.logprobs]
        assert [entry.token_id for entry in entries] == tokens
        assert all(len(entry.top_token_ids) == params.logprobs for entry in entries)
        assert all(not math.isnan(entry.logprob) and entry.logprob <= 0 for entry in entries)
    if last.finish_reason == generation_pb2.FINISH_REASON_STOP:
        # EOS and stop ids are masked for the first min_tokens tokens.
        assert len(tokens) > params.min_tokens
    # The prompt's log-probabilities come once, on the first response, when asked for.
    assert all(len(response.prompt_logprobs) == 0 for response in responses[1:])
    prompt_entries = responses[0].prompt_logprobs
    if params.HasField("prompt_logprobs"):
        assert [entry.token_id for entry in prompt_entries] == list(request.prompt_token_ids)[1:]
        assert all(len(entry.top_token_ids) == params.prompt_logprobs for entry in prompt_entries)
        assert all(not math.isnan(entry.logprob) and entry.logprob <= 0 for entry in prompt_entries)
    else:
        assert len(prompt_entries) == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_after_fuzzing_workers_are_idle_and_hold_no_blocks(cluster: InProcessCluster) -> None:
    for report in await cluster.wait_idle():
        assert (report.num_running, report.num_waiting) == (0, 0), report.role
        assert report.num_free_blocks == report.num_total_blocks == NUM_KV_BLOCKS, report.role
