"""Requests a decode worker starts when their pushed KV is complete, before their Decode arrives.

A push whose request goes on ends with its ``KVPushStart``: the prompt, the
sampling parameters and the handoff its Decode will carry. The decode worker
starts the request then (``DecodeServicer._start_early``) instead of when the
gateway's Decode arrives one hop later, and the Decode claims it here. A
Decode that carries something else ends it (and is served as any other); one
that does not come within ``timeout_s`` (the engine's one handoff deadline,
``EngineConfig.kv_handoff_timeout_s``) ends it too, as does a DropPush (from the
decode worker the gateway sent the Decode to instead). A push that completes while its request already
runs here (a retried prefill pushed again) starts nothing: its Decode either
attaches to the running request or, carrying the new handoff, ends it and
takes the new push. Ending cancels the wait for the first output and
closes the stream, which aborts the engine's request and frees its blocks.

The prefill worker's copy of the KV (its lease) outlives the start: a Decode
that differs, or one the gateway sends to another decode worker, pulls it.
The claimant lets it go once its first output is there
(``EarlyStart.release_lease``), and so does the expiry, which no Decode
follows. A DropPush or a closing worker leaves it to the decode worker that
serves the request (which pulls it, then releases it) or to the lease's own
expiry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from pdserve.engine.types.errors import EngineDeadError
from pdserve.engine.types.outputs import RequestOutput
from pdserve.protos.pdserve.v1.internal import worker_pb2

log = logging.getLogger(__name__)


@dataclass
class EarlyStart:
    """A running request and the push start it came from."""

    start: worker_pb2.KVPushStart
    stream: AsyncGenerator[RequestOutput, None]
    # The first output (the KV landed).
    first: asyncio.Future[RequestOutput]
    # Lets go of the prefill worker's copy of the KV: the claimant's, once the first output is there.
    release_lease: Callable[[], None]
    # Aborts the engine's request and returns once that has run: its engine id is free again.
    abort: Callable[[], Awaitable[None]]
    expiry: asyncio.TimerHandle | None = None

    def matches(self, request: worker_pb2.DecodeRequest) -> bool:
        return (
            self.start.prompt_token_ids == request.prompt_token_ids
            and self.start.sampling_params == request.sampling_params
            and self.start.handoff == request.handoff
        )


class EarlyStarts:
    """Early-started requests by the prefill worker's request id, each waiting at most ``timeout_s`` for its
    Decode (the handoff deadline)."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._waiting: dict[str, EarlyStart] = {}
        # Requests dropped here (DropPush, Abort): a start of theirs that comes later is not started.
        self._dropped: set[str] = set()
        self._ending: set[asyncio.Task[None]] = set()
        self.num_started = 0
        self.num_claimed = 0
        self.num_ended = 0  # expired, dropped, mismatched or closed
        self.num_expired = 0  # of those, ended because no Decode came in time

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def add(self, request_id: str, early: EarlyStart) -> None:
        """Keep ``early`` for its Decode; the caller checked that ``request_id`` has none waiting."""
        assert request_id not in self._waiting, request_id
        early.expiry = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, request_id, early)
        self._waiting[request_id] = early
        self.num_started += 1

    async def claim(self, request: worker_pb2.DecodeRequest) -> EarlyStart | None:
        """The request ``request`` started early, now its caller's to stream and close; None when there is none.

        One that differs from ``request`` is ended first (its engine id is free again when this returns).
        """
        early = self._waiting.pop(request.handoff.request_id, None)
        if early is None:
            return None
        if early.expiry is not None:
            early.expiry.cancel()
        if not early.matches(request):
            log.warning("the Decode of %s differs from what its push announced: the request restarts",
                        request.handoff.request_id)
            # Shielded: a cancelled Decode leaves the ending to finish on its own.
            await asyncio.shield(self._end(early))
            return None
        self.num_claimed += 1
        return early

    def drop(self, request_id: str) -> None:
        """End the request ``request_id`` started early, if any (its request ended before its Decode), and
        remember for ``timeout_s`` that it ended (``was_dropped``)."""
        early = self._waiting.pop(request_id, None)
        if early is not None:
            self._end(early)
        if request_id not in self._dropped:
            self._dropped.add(request_id)
            asyncio.get_running_loop().call_later(self.timeout_s, self._dropped.discard, request_id)

    def was_dropped(self, request_id: str) -> bool:
        """Whether ``request_id`` was dropped here within the last ``timeout_s``: a push of it that completes
        now starts nothing."""
        return request_id in self._dropped

    async def close(self) -> None:
        for request_id in list(self._waiting):
            self.drop(request_id)
        await asyncio.gather(*self._ending, return_exceptions=True)

    def _expire(self, request_id: str, early: EarlyStart) -> None:
        if self._waiting.get(request_id) is early:
            log.warning("no Decode claimed %s, started on its push, in %g s: ended", request_id, self.timeout_s)
            del self._waiting[request_id]
            self.num_expired += 1
            self._end(early)
            early.release_lease()  # no Decode is coming to pull it either

    def _end(self, early: EarlyStart) -> asyncio.Task[None]:
        if early.expiry is not None:
            early.expiry.cancel()
        self.num_ended += 1
        task = asyncio.get_running_loop().create_task(_close(early))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)
        return task


async def _close(early: EarlyStart) -> None:
    # Cancelling the first output's wait aborts a request still waiting for its KV; closing
    # the stream aborts one that already runs (an async generator cannot close mid-anext).
    early.first.cancel()
    await asyncio.gather(early.first, return_exceptions=True)
    await early.stream.aclose()
    # Closing queues the engine's abort; waiting for it makes the ending complete when this task is,
    # the request's blocks free before a Decode that differs restarts it under the same id. (No output
    # of this request reaches the restart's stream either way: the engine attaches a new stream on its
    # own thread, after every abort queued before it.)
    try:
        await early.abort()
    except EngineDeadError:
        pass  # it died or stops meanwhile: its requests went with it
