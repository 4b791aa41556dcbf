"""A corpus of bad requests: each gets its exact status and a message naming the field; the cluster stays healthy."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.gateway.validation import RequestLimits, validate_generate_request
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from tests.conftest import VOCAB_SIZE
from tests.support.cluster import NUM_KV_BLOCKS, InProcessCluster

MAX_CONTEXT = 1024  # the tiny checkpoint's max_position_embeddings
INVALID = grpc.StatusCode.INVALID_ARGUMENT
TOO_LARGE = grpc.StatusCode.RESOURCE_EXHAUSTED

GenerateRequest = generation_pb2.GenerateRequest
SamplingParams = generation_pb2.SamplingParams


@dataclass(frozen=True)
class BadRequest:
    """One entry of the corpus: what is sent, the status it must get, and text its message must hold."""

    name: str
    request: GenerateRequest
    code: grpc.StatusCode
    field: str  # the field the message must name (for RESOURCE_EXHAUSTED: grpc's own words)


def _ids(*token_ids: int, **params: object) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=list(token_ids), sampling_params=SamplingParams(**params))


def _params(**params: object) -> GenerateRequest:
    return _ids(1, 2, 3, **params)


def _bad(name: str, request: GenerateRequest, field: str, code: grpc.StatusCode = INVALID) -> BadRequest:
    return BadRequest(name, request, code, field)


CORPUS = [
    # The prompt.
    _bad("no_prompt", GenerateRequest(), "prompt must not be empty"),
    _bad("no_prompt_with_params", GenerateRequest(sampling_params=SamplingParams(max_tokens=4)), "prompt"),
    _bad("both_prompts", GenerateRequest(prompt="x", prompt_token_ids=[1]), "prompt and prompt_token_ids"),
    _bad("text_without_tokenizer", GenerateRequest(prompt="hello"), "prompt (text) needs a tokenizer"),
    _bad("unicode_text_without_tokenizer", GenerateRequest(prompt="\u00e9\u4e2d\U0001f600" * 100), "prompt"),
    _bad("token_at_vocab_size", _ids(1, VOCAB_SIZE), f"prompt_token_ids[1] = {VOCAB_SIZE} is outside the vocabulary"),
    _bad("token_uint32_max", _ids(2**32 - 1), "prompt_token_ids[0]"),
    _bad("one_bad_token_among_many", _ids(*range(2, 300), 100_000), "prompt_token_ids[298]"),
    # Prompt plus max_tokens against the context (1024).
    _bad("prompt_fills_context", _ids(*[5] * MAX_CONTEXT, max_tokens=1), "prompt_token_ids (1024 tokens)"),
    _bad("default_max_tokens_overflows", _ids(*[5] * (MAX_CONTEXT - 15)), "max_tokens (16, the default)"),
    _bad("max_tokens_one_past_context", _ids(1, max_tokens=MAX_CONTEXT), "sampling_params.max_tokens (1024)"),
    _bad("max_tokens_int32_max", _params(max_tokens=2**31 - 1), "sampling_params.max_tokens"),
    _bad("million_token_prompt", _ids(*[300] * 1_000_000), "prompt_token_ids (1000000 tokens)"),
    # max_tokens.
    _bad("max_tokens_zero", _params(max_tokens=0), "sampling_params.max_tokens must be >= 1"),
    _bad("max_tokens_negative", _params(max_tokens=-1), "sampling_params.max_tokens"),
    _bad("max_tokens_int32_min", _params(max_tokens=-(2**31)), "sampling_params.max_tokens"),
    # temperature.
    _bad("temperature_negative", _params(temperature=-0.5), "sampling_params.temperature"),
    _bad("temperature_tiny_negative", _params(temperature=-1e-300), "sampling_params.temperature"),
    _bad("temperature_nan", _params(temperature=float("nan")), "sampling_params.temperature"),
    _bad("temperature_inf", _params(temperature=float("inf")), "sampling_params.temperature"),
    _bad("temperature_minus_inf", _params(temperature=float("-inf")), "sampling_params.temperature"),
    # top_p.
    _bad("top_p_zero", _params(top_p=0.0), "sampling_params.top_p must be in (0, 1], got 0.0"),
    _bad("top_p_above_one", _params(top_p=1.5), "sampling_params.top_p must be in (0, 1], got 1.5"),
    _bad("top_p_negative", _params(top_p=-1.0), "sampling_params.top_p"),
    _bad("top_p_nan", _params(top_p=float("nan")), "sampling_params.top_p"),
    _bad("top_p_inf", _params(top_p=float("inf")), "sampling_params.top_p"),
    # top_k.
    _bad("top_k_zero", _params(top_k=0), "sampling_params.top_k"),
    _bad("top_k_minus_two", _params(top_k=-2), "sampling_params.top_k"),
    _bad("top_k_int32_min", _params(top_k=-(2**31)), "sampling_params.top_k"),
    # seed.
    _bad("seed_negative", _params(seed=-1), "sampling_params.seed"),
    _bad("seed_int64_min", _params(seed=-(2**63)), "sampling_params.seed"),
    # stop strings.
    _bad("stop_empty", _params(stop=[""]), "sampling_params.stop[0] must not be empty"),
    _bad("stop_second_empty", _params(stop=["a", ""]), "sampling_params.stop[1]"),
    _bad("stop_too_many", _params(stop=[f"s{i}" for i in range(17)]), "sampling_params.stop holds 17 strings"),
    _bad("stop_too_long", _params(stop=["x" * 257]), "sampling_params.stop[0] is 257 characters long"),
    # Valid at the gateway; the worker's engine has no tokenizer to match stop strings with.
    _bad("stop_without_worker_tokenizer", _params(stop=["x"]), "stop strings need a tokenizer"),
    # stop token ids.
    _bad("stop_token_at_vocab_size", _params(stop_token_ids=[7, VOCAB_SIZE]), "sampling_params.stop_token_ids[1]"),
    _bad("stop_token_uint32_max", _params(stop_token_ids=[2**32 - 1]), "sampling_params.stop_token_ids[0]"),
    _bad("stop_token_ids_too_many", _params(stop_token_ids=[7] * 257), "sampling_params.stop_token_ids holds 257"),
    # logprobs.
    _bad("logprobs_negative", _params(logprobs=-1), "sampling_params.logprobs must be in [0, 20]"),
    _bad("logprobs_above_max", _params(logprobs=21), "sampling_params.logprobs"),
    _bad("logprobs_above_vocab", _params(logprobs=VOCAB_SIZE + 1), "sampling_params.logprobs"),
    _bad("logprobs_int32_max", _params(logprobs=2**31 - 1), "sampling_params.logprobs"),
    # prompt_logprobs (same limit as logprobs).
    _bad("prompt_logprobs_negative", _params(prompt_logprobs=-1), "sampling_params.prompt_logprobs must be in [0, 20]"),
    _bad("prompt_logprobs_above_max", _params(prompt_logprobs=21), "sampling_params.prompt_logprobs"),
    # min_tokens: 0 <= min_tokens <= max_tokens (16 when unset).
    _bad("min_tokens_negative", _params(min_tokens=-1), "sampling_params.min_tokens must be in [0, max_tokens=16]"),
    _bad("min_tokens_above_max_tokens", _params(max_tokens=4, min_tokens=5), "sampling_params.min_tokens"),
    # Penalties.
    _bad("presence_penalty_above_two", _params(presence_penalty=2.5), "sampling_params.presence_penalty must be in"),
    _bad("presence_penalty_nan", _params(presence_penalty=float("nan")), "sampling_params.presence_penalty"),
    _bad("frequency_penalty_below", _params(frequency_penalty=-2.01), "sampling_params.frequency_penalty must be"),
    _bad("frequency_penalty_inf", _params(frequency_penalty=float("inf")), "sampling_params.frequency_penalty"),
    _bad("repetition_penalty_zero", _params(repetition_penalty=0.0), "sampling_params.repetition_penalty must be"),
    _bad("repetition_penalty_negative", _params(repetition_penalty=-1.0), "sampling_params.repetition_penalty"),
    _bad("repetition_penalty_above_ten", _params(repetition_penalty=10.5), "sampling_params.repetition_penalty"),
    _bad("repetition_penalty_nan", _params(repetition_penalty=float("nan")), "sampling_params.repetition_penalty"),
    # logit_bias.
    _bad("logit_bias_above_100", _params(logit_bias={5: 100.5}), "sampling_params.logit_bias[5] must be in"),
    _bad("logit_bias_nan", _params(logit_bias={5: float("nan")}), "sampling_params.logit_bias[5]"),
    # Several entries out of range: the smallest token id is named, whatever order the map crossed the wire in.
    _bad(
        "logit_bias_several_out_of_range", _params(logit_bias={40: 101.0, 8: -101.0, 300: 100.5, 9: 150.0}),
        "sampling_params.logit_bias[8] must be in [-100, 100], got -101.0",
    ),
    _bad("logit_bias_key_at_vocab", _params(logit_bias={VOCAB_SIZE: 1.0}), f"sampling_params.logit_bias key {VOCAB_SIZE}"),
    _bad("logit_bias_too_many", _params(logit_bias={i: 1.0 for i in range(1025)}), "sampling_params.logit_bias holds"),
    # request_id.
    _bad("request_id_too_long", GenerateRequest(request_id="r" * 257, prompt_token_ids=[1]), "request_id is 257"),
    _bad("request_id_huge", GenerateRequest(request_id="r" * 100_000, prompt_token_ids=[1]), "request_id"),
    _bad("request_id_nul", GenerateRequest(request_id="a\x00b", prompt_token_ids=[1]), "request_id must hold"),
    _bad("request_id_newline", GenerateRequest(request_id="a\nlevel=error", prompt_token_ids=[1]), "request_id"),
    _bad("request_id_ansi_escape", GenerateRequest(request_id="\x1b[31mred", prompt_token_ids=[1]), "request_id"),
    _bad("request_id_line_separator", GenerateRequest(request_id="a\u2028b", prompt_token_ids=[1]), "request_id"),
    _bad("request_id_bidi_override", GenerateRequest(request_id="a\u202eb", prompt_token_ids=[1]), "request_id"),
    # Over the 4 MiB message limit: grpc refuses it before any handler runs.
    _bad("prompt_text_5_mib", GenerateRequest(prompt="x" * (5 << 20)), "larger than max", TOO_LARGE),
    _bad("token_ids_over_4_mib", _ids(*[300] * 2_200_000), "larger than max", TOO_LARGE),
    _bad("stop_strings_over_4_mib", _params(stop=["y" * (1 << 20)] * 5), "larger than max", TOO_LARGE),
]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(llama_checkpoint: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(llama_checkpoint) as cluster:
        yield cluster


def test_corpus_is_large_and_names_are_unique() -> None:
    assert len(CORPUS) >= 40
    assert len({bad.name for bad in CORPUS}) == len(CORPUS)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("bad", CORPUS, ids=[bad.name for bad in CORPUS])
async def test_bad_request_gets_its_status_and_a_message_naming_the_field(
    cluster: InProcessCluster, bad: BadRequest
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await cluster.generate(bad.request)
    assert caught.value.code() == bad.code, caught.value.details()
    assert bad.field in (caught.value.details() or "")


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    "raw",
    [bytes([0x12, 2, 0xFF, 0xFE]), b"\xff\xff\xff\xff", bytes([0x1A, 10, 1])],
    ids=["prompt_bad_utf8", "corrupt_wire_format", "truncated_sampling_params"],
)
async def test_unparsable_request_is_invalid_argument(cluster: InProcessCluster, raw: bytes) -> None:
    assert cluster.channel is not None
    generate = cluster.channel.unary_stream(
        "/pdserve.v1.Generation/Generate",
        request_serializer=lambda message: message,  # the bytes as they are
        response_deserializer=generation_pb2.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _ = [response async for response in generate(raw, timeout=20)]
    assert caught.value.code() == INVALID
    assert "does not parse" in (caught.value.details() or "")


@pytest.mark.asyncio(loop_scope="module")
async def test_after_the_corpus_good_requests_are_served_and_workers_are_idle(cluster: InProcessCluster) -> None:
    # The longest prompt the context allows with max_tokens=2, and a short sampled one with every option set.
    at_limit = _ids(*[5] * (MAX_CONTEXT - 2), max_tokens=2, temperature=0.0, ignore_eos=True)
    full = GenerateRequest(
        request_id="good-1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(
            max_tokens=4, temperature=0.7, top_p=0.9, top_k=50, seed=3, stop_token_ids=[7], logprobs=20, ignore_eos=True,
            min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
            logit_bias={9: 2.0, 10: -2.0}, prompt_logprobs=20,
        ),
    )
    for request in (at_limit, full):
        responses = await cluster.generate(request)
        tokens = [token for response in responses for token in response.token_ids]
        last = responses[-1]
        # Stop token 7 may be sampled before max_tokens.
        stop_or_length = generation_pb2.FINISH_REASON_STOP if 7 in tokens else generation_pb2.FINISH_REASON_LENGTH
        assert last.finish_reason == stop_or_length
        assert last.usage.prompt_tokens == len(request.prompt_token_ids)
        assert last.usage.completion_tokens == len(tokens) <= request.sampling_params.max_tokens
    assert [len(entry.top_token_ids) for response in responses for entry in response.logprobs] == [20] * len(tokens)
    assert [(entry.token_id, len(entry.top_token_ids)) for entry in responses[0].prompt_logprobs] == [(2, 20), (3, 20)]
    for report in await cluster.wait_idle():
        assert (report.num_running, report.num_waiting) == (0, 0), report.role
        assert report.num_free_blocks == report.num_total_blocks == NUM_KV_BLOCKS, report.role
    assert cluster.channel is not None
    health = await health_pb2_grpc.HealthStub(cluster.channel).Check(
        health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.asyncio(loop_scope="module")
async def test_prefill_with_the_id_of_a_held_request_is_refused_and_leaks_nothing(llama_checkpoint: Path) -> None:
    # Its own cluster: when the bug bites, the leaked blocks would fail the shared cluster's idle check.
    async with InProcessCluster(llama_checkpoint) as cluster:
        prefill = cluster.worker_stubs[0]
        request = worker_pb2.PrefillRequest(
            request_id="same", prompt_token_ids=list(range(10, 60)), sampling_params=SamplingParams(max_tokens=8)
        )
        await prefill.Prefill(request, timeout=20)  # held, as for a decode worker's fetch
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await prefill.Prefill(request, timeout=20)
        assert caught.value.code() == INVALID
        assert "already in use" in caught.value.details()
        await prefill.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="same"), timeout=5)
        reports = await cluster.wait_idle()
        assert [r.num_free_blocks for r in reports] == [NUM_KV_BLOCKS, NUM_KV_BLOCKS]


def test_model_checks_wait_for_a_worker_report() -> None:
    # No worker has reported: out-of-vocabulary ids and an over-long completion pass to the engine's checks.
    request = _ids(100_000, max_tokens=1_000_000, stop_token_ids=[100_000])
    validate_generate_request(request, list(request.prompt_token_ids), RequestLimits())
    with pytest.raises(ValueError, match=r"^prompt_token_ids\[0\] = 100000 is outside the vocabulary \[0, 512\)$"):
        validate_generate_request(
            _ids(100_000), [100_000], RequestLimits().for_model(vocab_size=512, max_context_length=1024)
        )


def test_max_logprobs_is_configurable() -> None:
    request = _params(logprobs=64)
    validate_generate_request(request, [1, 2, 3], RequestLimits(max_logprobs=64))
    with pytest.raises(ValueError, match=r"^sampling_params\.logprobs must be in \[0, 20\], got 64$"):
        validate_generate_request(request, [1, 2, 3], RequestLimits())


def test_prompt_logprobs_share_the_configurable_max_logprobs() -> None:
    request = _params(prompt_logprobs=64)
    validate_generate_request(request, [1, 2, 3], RequestLimits(max_logprobs=64))
    with pytest.raises(ValueError, match=r"^sampling_params\.prompt_logprobs must be in \[0, 20\], got 64$"):
        validate_generate_request(request, [1, 2, 3], RequestLimits())


def test_new_sampling_fields_at_their_limits_are_accepted() -> None:
    limits = RequestLimits().for_model(vocab_size=512, max_context_length=1024)
    request = _params(
        max_tokens=4, min_tokens=4, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=10.0,
        logit_bias={0: -100.0, 511: 100.0}, prompt_logprobs=20,
    )
    validate_generate_request(request, [1, 2, 3], limits)
    # min_tokens is checked against the default max_tokens (16) when max_tokens is unset.
    validate_generate_request(_params(min_tokens=16), [1, 2, 3], limits)
    with pytest.raises(ValueError, match=r"^sampling_params\.min_tokens must be in \[0, max_tokens=16\], got 17$"):
        validate_generate_request(_params(min_tokens=17), [1, 2, 3], limits)
    with pytest.raises(ValueError, match=r"^sampling_params\.logit_bias key 512 is outside the vocabulary \[0, 512\)$"):
        validate_generate_request(_params(logit_bias={3: 1.0, 512: 1.0, 900: 1.0}), [1, 2, 3], limits)
