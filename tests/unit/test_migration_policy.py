"""A stream's moves between decode workers on hand-made workers (no servers): the bounds --max-migrations and
--migration-timeout set, the resume request, and what the metrics count."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.gateway.decode_stream import DecodeStream, MigrationPolicy
from pdserve.gateway.migration import migrate, resume_request
from pdserve.gateway.router import Router
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.service_common.errors import Unavailable
from pdserve.service_common.metrics import GatewayMetrics
from tests.support.decode_workers import DecodeCall, decode_router

REQUEST = generation_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling_params=generation_pb2.SamplingParams(
    max_tokens=20, temperature=0.0, prompt_logprobs=1))


async def _run(router: Router, metrics: GatewayMetrics, generated: list[int], policy: MigrationPolicy) -> list[int]:
    stream = DecodeStream(router, metrics, policy, REQUEST, "r", [5, 6, 7], None, lambda: None, generated=generated,
                          failed={"127.0.0.1:9"})
    tokens: list[int] = []
    async for piece in migrate(stream, "decode_unavailable"):
        tokens.extend(piece.token_ids)
    return tokens


def _count(metrics: GatewayMetrics, outcome: str) -> float:
    return metrics.migrations.labels("decode_unavailable", outcome)._value.get()


@pytest.mark.asyncio
async def test_a_stream_moves_again_when_its_new_worker_fails_and_each_resume_carries_what_was_sent() -> None:
    router, stubs = decode_router([DecodeCall([[10], [11]], fail=True), DecodeCall([[12], [13]])])
    metrics, generated = GatewayMetrics(), [1, 2]
    assert await _run(router, metrics, generated, MigrationPolicy(3, 5.0)) == [10, 11, 12, 13]
    assert generated == [1, 2, 10, 11, 12, 13]
    assert [list(r.resume_token_ids) for r in stubs[0].requests + stubs[1].requests] == [[1, 2], [1, 2, 10, 11]]
    first = stubs[0].requests[0]
    assert (list(first.prompt_token_ids), first.sampling_params.HasField("prompt_logprobs")) == ([5, 6, 7], False)
    assert (_count(metrics, "resumed"), stubs[0].call.cancelled) == (2, True)


@pytest.mark.asyncio
async def test_past_max_migrations_the_stream_ends_unavailable_saying_why() -> None:
    router, _ = decode_router([DecodeCall([], fail=True), DecodeCall([], fail=True), DecodeCall([], fail=True)])
    metrics = GatewayMetrics()
    with pytest.raises(Unavailable, match=r"failed 3 times \(--max-migrations 2\); it ends after 2 tokens"):
        await _run(router, metrics, [1, 2], MigrationPolicy(2, 5.0))
    assert _count(metrics, "gave_up") == 1


@pytest.mark.asyncio
async def test_a_new_worker_that_sends_nothing_within_the_migration_timeout_ends_the_stream() -> None:
    router, _ = decode_router([DecodeCall([], hang=True)])
    metrics = GatewayMetrics()
    with pytest.raises(Unavailable, match=r"not resumed within --migration-timeout 0.2 s"):
        await asyncio.wait_for(_run(router, metrics, [1], MigrationPolicy(3, 0.2)), 5)
    assert _count(metrics, "timed_out") == 1


def test_the_policy_refuses_bad_bounds_and_resume_request_clears_prompt_logprobs() -> None:
    with pytest.raises(ValueError, match="max_migrations must be >= 0"):
        MigrationPolicy(-1)
    with pytest.raises(ValueError, match="migration timeout must be > 0 seconds"):
        MigrationPolicy(3, 0)
    request = resume_request(REQUEST, "r", [5, 6, 7], [9], None)
    assert list(request.resume_token_ids) == [9] and not request.HasField("handoff")
