"""``EarlyStarts`` on its own: what ends a request started on its push, and that ending closes its stream.

The cluster tests (tests/cluster/test_kv_push.py) run it inside a decode worker; these
use stand-in streams, so that each way of ending is seen at both of its points: the
request still waiting for its first output, and the request running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from pdserve.decode_service.early_start import EarlyStart, EarlyStarts
from pdserve.engine.types.errors import EngineDeadError
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2

START = worker_pb2.KVPushStart(
    prompt_token_ids=[3, 4, 5],
    sampling_params=generation_pb2.SamplingParams(max_tokens=8),
    handoff=worker_pb2.KVHandoff(request_id="r", num_tokens=3),
)


class _Request:
    """A stand-in engine stream: its first output once ``landed`` is set, then one output an hour."""

    def __init__(self) -> None:
        self.landed = asyncio.Event()
        self.closed = False
        self.leases_released = 0
        self.aborted = False

    def release_lease(self) -> None:
        self.leases_released += 1

    async def abort(self) -> None:
        assert self.closed  # the engine's abort comes after the stream closed
        self.aborted = True

    async def stream(self) -> AsyncGenerator[str, None]:
        try:
            await self.landed.wait()
            yield "first"
            await asyncio.sleep(3600)
            yield "second"
        finally:
            self.closed = True  # where the engine's request is aborted


async def _started(landed: bool) -> tuple[_Request, EarlyStart]:
    request = _Request()
    stream = request.stream()
    first = asyncio.ensure_future(anext(stream))
    if landed:
        request.landed.set()
        assert await first == "first"
    return request, EarlyStart(START, stream, first, request.release_lease, request.abort)


def _decode(**changes: object) -> worker_pb2.DecodeRequest:
    decode = worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=START.prompt_token_ids,
                                      sampling_params=START.sampling_params, handoff=START.handoff, kv_pushed=True)
    for name, value in changes.items():
        field = getattr(decode, name)
        if isinstance(value, list):
            del field[:]
            field.extend(value)
        else:
            field.CopyFrom(value)
    return decode


@pytest.mark.asyncio
@pytest.mark.parametrize("landed", [False, True])
async def test_a_matching_decode_claims_the_running_request_once(landed: bool) -> None:
    starts = EarlyStarts(timeout_s=60.0)
    request, early = await _started(landed)
    starts.add("r", early)
    assert "r" in starts
    assert await starts.claim(_decode()) is early
    assert await starts.claim(_decode()) is None  # claimed: gone
    assert (starts.num_started, starts.num_claimed, starts.num_ended, len(starts)) == (1, 1, 0, 0)
    assert not request.closed  # the claimer streams and closes it
    assert request.leases_released == 0  # and lets go of the prefill worker's copy
    early.first.cancel()
    await early.stream.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("landed", [False, True])
@pytest.mark.parametrize("change", [
    {"prompt_token_ids": [3, 4, 6]},
    {"sampling_params": generation_pb2.SamplingParams(max_tokens=9)},
    {"handoff": worker_pb2.KVHandoff(request_id="r", num_tokens=3, epoch=2)},
])
async def test_a_decode_that_differs_ends_the_request_before_it_is_served(change: dict, landed: bool) -> None:
    starts = EarlyStarts(timeout_s=60.0)
    request, early = await _started(landed)
    starts.add("r", early)
    assert await starts.claim(_decode(**change)) is None
    # Ended before claim returns, the engine's abort included: the Decode may reuse the engine's request id at once.
    assert request.closed and request.aborted and early.first.done()
    assert (starts.num_claimed, starts.num_ended, len(starts)) == (0, 1, 0)
    assert request.leases_released == 0  # the Decode pulls it


@pytest.mark.asyncio
@pytest.mark.parametrize("landed", [False, True])
@pytest.mark.parametrize("ending", ["drop", "expiry", "close"])
async def test_drop_expiry_and_close_end_the_request_and_close_its_stream(ending: str, landed: bool) -> None:
    starts = EarlyStarts(timeout_s=0.05 if ending == "expiry" else 60.0)
    request, early = await _started(landed)
    starts.add("r", early)
    if ending == "drop":
        starts.drop("r")
        starts.drop("r")  # twice: nothing more
    elif ending == "expiry":
        await asyncio.sleep(0.2)
    await starts.close()  # also waits for the endings under way
    assert request.closed and request.aborted and early.first.done()
    assert (starts.num_ended, len(starts), await starts.claim(_decode())) == (1, 0, None)
    # Only the expiry lets go of the prefill worker's copy: after a DropPush, or on a closing worker,
    # the gateway may serve the request on another decode worker, which pulls it.
    assert request.leases_released == (1 if ending == "expiry" else 0)


@pytest.mark.asyncio
async def test_an_engine_that_died_meanwhile_does_not_fail_the_ending() -> None:
    # The engine's abort finds it dead: its requests went with it, and the ending completes quietly
    # (a claim that ends a differing request raises nothing of it into the Decode).
    starts = EarlyStarts(timeout_s=60.0)
    request, early = await _started(landed=True)

    async def engine_dead() -> None:
        raise EngineDeadError("the engine stopped")

    early.abort = engine_dead
    starts.add("r", early)
    assert await starts.claim(_decode(prompt_token_ids=[3, 4, 6])) is None
    assert request.closed and (starts.num_ended, len(starts)) == (1, 0)


def test_the_time_to_live_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        EarlyStarts(timeout_s=0)
