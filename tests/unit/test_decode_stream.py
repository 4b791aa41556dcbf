"""The one loop that reads a decode worker's stream (pdserve/gateway/decode_stream.py), on hand-made workers: what
it counts in flight and when, what it relays, how it ends on a failure; and the three paths that use it — the
relay after a prefill worker's first token, a prefill on the decode worker, a stream moved to another worker."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from pdserve.gateway.decode_stream import DecodeStream, MigrationPolicy
from pdserve.gateway.disaggregation import LOCAL, RouteDecision
from pdserve.gateway.prefill_route import Route, stream_local_prefill
from pdserve.gateway.router import Router
from pdserve.gateway.server import GenerationServicer
from pdserve.gateway.workers import WorkerHandle
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.errors import Unavailable
from pdserve.service_common.metrics import GatewayMetrics
from tests.support.decode_workers import DecodeCall, decode_router

PROMPT = [5, 6, 7]
REQUEST = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, sampling_params=generation_pb2.SamplingParams(
    max_tokens=4, temperature=0.0))
LENGTH = generation_pb2.FINISH_REASON_LENGTH


def _last(*token_ids: int) -> worker_pb2.DecodeResponse:
    return worker_pb2.DecodeResponse(token_ids=token_ids, finish_reason=LENGTH, cached_prompt_tokens=2)


def _stream(router: Router, metrics: GatewayMetrics | None = None,
            policy: MigrationPolicy = MigrationPolicy()) -> DecodeStream:
    return DecodeStream(router, metrics or GatewayMetrics(), policy, REQUEST, "r", PROMPT, None, lambda: None)


def _worker(router: Router, index: int) -> WorkerHandle:
    return router.pool.workers[f"decode@{index}"]


def _retries(metrics: GatewayMetrics) -> float:
    return metrics.worker_retries.labels("decode")._value.get()


@pytest.mark.asyncio
async def test_a_relay_counts_the_request_and_its_queued_tokens_until_the_first_piece_then_relays_to_the_finish(
) -> None:
    router, stubs = decode_router([DecodeCall([[10, 11], _last(12)])])
    worker, stream = _worker(router, 0), _stream(router)
    lead = generation_pb2.GenerateResponse(request_id="r", token_ids=[9])
    first_pieces: list[list[int]] = []
    seen = [
        (list(response.token_ids), worker.inflight_requests, worker.inflight_tokens, response.finish_reason,
         response.usage.completion_tokens)
        async for response in stream.relay(worker, worker_pb2.DecodeRequest(request_id="r"), lead=lead,
                                           queued_tokens=3,
                                           on_first_piece=lambda piece: first_pieces.append(list(piece.token_ids)))
    ]
    assert seen == [([9], 1, 3, 0, 0), ([10, 11], 1, 0, 0, 0), ([12], 1, 0, LENGTH, 3)]
    assert (worker.inflight_requests, worker.inflight_tokens) == (0, 0)
    assert first_pieces == [[10, 11]]
    assert (stream.generated, stream.usage.prompt_tokens, stream.finished, stream.received) == ([10, 11, 12], 3, True,
                                                                                                  True)
    # A finished call is not cancelled: the worker's request has ended already.
    assert (stream.failure, stubs[0].call.cancelled, worker.healthy) == (None, False, True)


@pytest.mark.asyncio
async def test_a_worker_failing_unavailable_ends_the_relay_with_the_worker_out_of_rotation_and_nothing_raised() -> None:
    router, stubs = decode_router([DecodeCall([[10]], fail=True)])
    worker, stream = _worker(router, 0), _stream(router)
    tokens = [list(r.token_ids) async for r in stream.relay(worker, worker_pb2.DecodeRequest(), queued_tokens=3)]
    assert tokens == [[10]]
    assert stream.failure is not None and stream.failure.code() == grpc.StatusCode.UNAVAILABLE
    assert (stream.received, stream.finished, stream.failed, stream.generated) == (True, False, {"127.0.0.1:1"}, [10])
    assert (worker.healthy, worker.inflight_requests, worker.inflight_tokens, stubs[0].call.cancelled) == (
        False, 0, 0, True)


@pytest.mark.asyncio
async def test_any_other_error_of_the_call_propagates_and_leaves_the_worker_in_rotation_and_uncounted() -> None:
    router, _ = decode_router([DecodeCall([], fail=grpc.StatusCode.INVALID_ARGUMENT)])
    worker, stream = _worker(router, 0), _stream(router)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _ = [r async for r in stream.relay(worker, worker_pb2.DecodeRequest(), queued_tokens=3)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (worker.healthy, stream.failed, worker.inflight_requests, worker.inflight_tokens) == (True, set(), 0, 0)


@pytest.mark.asyncio
async def test_a_client_gone_mid_stream_cancels_the_call_and_uncounts_it_at_once() -> None:
    router, stubs = decode_router([DecodeCall([[10], [11]], hang=True)])
    worker, stream = _worker(router, 0), _stream(router)
    async with contextlib.aclosing(stream.relay(worker, worker_pb2.DecodeRequest())) as responses:
        first = await anext(responses)
    assert (list(first.token_ids), stream.generated) == ([10], [10])
    assert (stubs[0].call.cancelled, worker.inflight_requests, worker.inflight_tokens) == (True, 0, 0)


@pytest.mark.asyncio
async def test_a_first_piece_later_than_its_deadline_raises_timeout_error() -> None:
    router, stubs = decode_router([DecodeCall([], hang=True)])
    worker, stream = _worker(router, 0), _stream(router)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(stream.relay(worker, worker_pb2.DecodeRequest(), first_piece_by=0.0)), 5)
    assert (stubs[0].call.cancelled, worker.inflight_requests) == (True, 0)


@pytest.mark.asyncio
async def test_a_local_prefill_reports_its_cached_prompt_and_moves_from_the_prompt_when_its_worker_fails_first(
) -> None:
    router, stubs = decode_router([DecodeCall([], fail=True), DecodeCall([[10], _last(11)])])
    stream = _stream(router)
    route = Route(RouteDecision(LOCAL, "no_prefill_worker"), decode=_worker(router, 0))
    responses = [r async for r in stream_local_prefill(stream, route)]
    assert [list(r.token_ids) for r in responses] == [[10], [11]]
    assert [list(r.resume_token_ids) for r in stubs[1].requests] == [[]]
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (3, 2, 0)


@pytest.mark.asyncio
async def test_a_local_prefill_ends_unavailable_saying_why_when_streams_are_not_moved() -> None:
    router, stubs = decode_router([DecodeCall([[10]], fail=True), DecodeCall([[11]])])
    stream = _stream(router, policy=MigrationPolicy(0))
    route = Route(RouteDecision(LOCAL, "no_prefill_worker"), decode=_worker(router, 0))
    tokens: list[list[int]] = []
    with pytest.raises(Unavailable, match=r"^the decode worker of this stream failed after 1 tokens "
                                          r"\(--max-migrations 0: streams are not moved\)$"):
        async for response in stream_local_prefill(stream, route):
            tokens.append(list(response.token_ids))
    assert (tokens, stubs[1].requests) == ([[10]], [])


def _prefill_response() -> worker_pb2.PrefillResponse:
    return worker_pb2.PrefillResponse(first_token_id=9, text="a", handoff=worker_pb2.KVHandoff(request_id="r"),
                                      cached_prompt_tokens=2)


@pytest.mark.asyncio
async def test_after_a_prefill_a_decode_worker_failing_before_its_first_token_is_replaced_by_one_that_pulls() -> None:
    router, stubs = decode_router([DecodeCall([], fail=True), DecodeCall([[10], _last(11)])])
    metrics = GatewayMetrics()
    servicer = GenerationServicer(router, None, "grpc", metrics=metrics)
    responses = [r async for r in servicer._relay(_stream(router, metrics), _prefill_response())]
    assert [list(r.token_ids) for r in responses] == [[9], [10], [11]]
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (3, 3, 2)
    retried = stubs[1].requests[0]
    assert (retried.handoff.request_id, retried.kv_pushed, retried.resume_token_ids) == ("r", False, [])
    assert (_retries(metrics), stubs[0].aborts, stubs[1].aborts) == (1, [], [])


@pytest.mark.asyncio
async def test_after_a_prefill_a_decode_worker_failing_mid_stream_moves_it_with_every_token_the_client_has() -> None:
    router, stubs = decode_router([DecodeCall([[10]], fail=True), DecodeCall([_last(11)])])
    metrics = GatewayMetrics()
    servicer = GenerationServicer(router, None, "grpc", metrics=metrics)
    responses = [r async for r in servicer._relay(_stream(router, metrics), _prefill_response())]
    assert [list(r.token_ids) for r in responses] == [[9], [10], [11]]
    assert responses[-1].usage.completion_tokens == 3
    resumed = stubs[1].requests[0]
    assert (list(resumed.resume_token_ids), resumed.HasField("handoff"), _retries(metrics)) == ([9, 10], False, 0)


@pytest.mark.asyncio
async def test_after_a_prefill_no_decode_worker_answering_relays_the_end_to_the_last_one_tried() -> None:
    router, stubs = decode_router([DecodeCall([], fail=True), DecodeCall([], fail=True)])
    servicer = GenerationServicer(router, None, "grpc")
    tokens: list[list[int]] = []
    with pytest.raises(Unavailable, match="^the decode worker of this stream failed after 1 tokens and no other"):
        async for response in servicer._relay(_stream(router), _prefill_response()):
            tokens.append(list(response.token_ids))
    await asyncio.gather(*servicer._background)
    assert tokens == [[9]]
    assert (stubs[0].aborts, [a.handoff.request_id for a in stubs[1].aborts]) == ([], ["r"])
