"""The runner against a fake backend: records, failures, the concurrency limit, arrival times."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.backend import BackendError, BackendRequest, ModelDescription, StreamChunk, Usage
from pdserve.bench.record import RequestError
from pdserve.bench.request import BenchRequest
from pdserve.bench.runner import RunConfig, SamplingConfig, run_requests

# First prompt ids that make the fake server misbehave.
FAIL_UNAVAILABLE, FAIL_CLIENT, NO_USAGE = 1, 2, 3


class FakeBackend:
    """Streams ``max_tokens`` tokens as chunks of up to two, 5 ms apart; counts requests in flight."""

    def __init__(self) -> None:
        self.requests: list[BackendRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def model_info(self) -> ModelDescription:
        return ModelDescription(model_id="fake", vocab_size=512, max_context_length=1024)

    async def stream(self, request: BackendRequest) -> AsyncIterator[StreamChunk]:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            first = (request.prompt_token_ids or (0,))[0]
            if first == FAIL_UNAVAILABLE:
                raise BackendError("UNAVAILABLE", "no worker")
            if first == FAIL_CLIENT:
                raise RuntimeError("decoder exploded")
            remaining = request.max_tokens
            while remaining:
                await asyncio.sleep(0.005)  # not a wait: the fake model's time per step, so that streams overlap
                size = min(2, remaining)
                remaining -= size
                usage = None
                if not remaining and first != NO_USAGE:
                    usage = Usage(
                        prompt_tokens=len(request.prompt_token_ids or ()),
                        completion_tokens=request.max_tokens,
                        cached_prompt_tokens=1,
                    )
                yield StreamChunk(timestamp=time.perf_counter(), num_tokens=size, usage=usage)
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        pass


def _requests(*first_ids: int, prompt_len: int = 4, output_len: int = 5) -> tuple[BenchRequest, ...]:
    return tuple(BenchRequest(prompt_token_ids=(first, *range(20, 20 + prompt_len - 1)), prompt=None,
                              output_len=output_len) for first in first_ids)


def test_every_request_gets_a_record_with_the_servers_counts_and_its_chunks() -> None:
    backend = FakeBackend()
    config = RunConfig(seed=10, sampling=SamplingConfig(temperature=0.5, ignore_eos=True, timeout_s=9.0),
                       request_id_prefix="run")
    outcome = asyncio.run(run_requests(backend, _requests(30, 31, 32), config))
    assert [r.index for r in outcome.records] == [0, 1, 2]
    for record in outcome.records:
        assert record.error is None
        assert (record.prompt_tokens, record.output_tokens, record.cached_prompt_tokens) == (4, 5, 1)
        assert record.chunk_tokens == (2, 2, 1)  # five tokens in chunks of up to two
        assert 0 <= record.start < record.chunk_times[0] < record.chunk_times[1] < record.chunk_times[2] <= record.end
        assert record.end <= outcome.duration_s
    sent = sorted(backend.requests, key=lambda r: r.request_id)
    assert [(r.request_id, r.seed, r.max_tokens, r.temperature, r.ignore_eos, r.timeout_s) for r in sent] == [
        ("run-0", 10, 5, 0.5, True, 9.0), ("run-1", 11, 5, 0.5, True, 9.0), ("run-2", 12, 5, 0.5, True, 9.0)]


def test_failures_become_records_instead_of_ending_the_run() -> None:
    requests = _requests(30, FAIL_UNAVAILABLE, FAIL_CLIENT, NO_USAGE)
    outcome = asyncio.run(run_requests(FakeBackend(), requests, RunConfig()))
    assert [r.error for r in outcome.records] == [
        None,
        RequestError("UNAVAILABLE", "no worker"),
        RequestError("CLIENT", "RuntimeError: decoder exploded"),
        RequestError("INCOMPLETE", "the stream ended without usage"),
    ]
    # A failed request reports no counts, even when it streamed tokens first.
    assert [(r.prompt_tokens, r.output_tokens) for r in outcome.records] == [(4, 5), (0, 0), (0, 0), (0, 0)]
    assert outcome.records[3].chunk_tokens == (2, 2, 1)


def test_max_concurrency_bounds_the_requests_in_flight() -> None:
    backend = FakeBackend()
    outcome = asyncio.run(run_requests(backend, _requests(*range(30, 36)), RunConfig(max_concurrency=2)))
    assert backend.max_in_flight == 2
    assert len(backend.requests) == 6
    assert all(r.ok for r in outcome.records)


def test_requests_are_sent_no_earlier_than_their_arrival_time() -> None:
    config = RunConfig(request_rate=100.0, burstiness=1.0, seed=4)
    outcome = asyncio.run(run_requests(FakeBackend(), _requests(*range(30, 38), output_len=1), config))
    offsets = arrival_offsets(8, 100.0, 1.0, seed=4)
    assert all(record.start >= offset for record, offset in zip(outcome.records, offsets))
    assert outcome.duration_s >= offsets[-1]


def test_a_bad_concurrency_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="--max-concurrency must be >= 1"):
        RunConfig(max_concurrency=0)
