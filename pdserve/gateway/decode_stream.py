"""A request's stream from the decode workers: one loop reads a worker's Decode stream and relays it.

Every stream the client receives from a decode worker — after a prefill
worker's first token (``GenerationServicer._relay``), from a prompt prefilled
on the decode worker (``stream_local_prefill``), or resumed on another worker
after its own failed (``migrate``) — is read by ``DecodeStream.relay``: the
request counted in flight on that worker, each piece turned into the client's
response (``relayed_response``, usage counted there), the tokens the client
has kept in ``generated``. A worker that fails the call UNAVAILABLE (crashed,
its engine dead, its connection gone) is taken out of rotation and the relay
ends with ``failure`` set: its caller hands the stream to migration
(pdserve/gateway/migration.py), or first retries another worker when nothing
came from that one. The stream carries its ``MigrationPolicy``: how far it
goes to outlive its worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from pdserve.gateway.workers import Inflight, WorkerHandle
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2

if TYPE_CHECKING:
    from pdserve.gateway.router import Router
    from pdserve.service_common.metrics import GatewayMetrics

DEFAULT_MAX_MIGRATIONS = 3
DEFAULT_MIGRATION_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class MigrationPolicy:
    """How far a stream goes to outlive its decode worker (the gateway's ``--max-migrations`` and
    ``--migration-timeout``): moves per request (0: none, the stream ends with UNAVAILABLE), and the longest
    from its worker failing until another's first token, across moves."""

    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    timeout_s: float = DEFAULT_MIGRATION_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not self.timeout_s > 0:
            raise ValueError(f"migration timeout must be > 0 seconds, got {self.timeout_s}")


@dataclass
class DecodeStream:
    """One request's stream to its client from decode workers: what resuming it needs (the request, its prompt,
    what the client received), its usage so far, and the outcome of its last ``relay``."""

    router: Router
    metrics: GatewayMetrics
    migration: MigrationPolicy
    request: generation_pb2.GenerateRequest
    request_id: str
    token_ids: list[int]  # the prompt
    lora: worker_pb2.LoRAAdapter | None
    time_remaining: Callable[[], float | None]  # the client's deadline
    generated: list[int] = field(default_factory=list)  # the tokens the client has received
    failed: set[str] = field(default_factory=set)  # the decode workers (addresses) that failed this stream
    usage: generation_pb2.Usage = field(init=False)
    finished: bool = field(default=False, init=False)  # a response with a finish reason was relayed
    received: bool = field(default=False, init=False)  # the last relay's worker sent a piece
    failure: grpc.aio.AioRpcError | None = field(default=None, init=False)  # the last relay's worker failed it

    def __post_init__(self) -> None:
        self.usage = generation_pb2.Usage(prompt_tokens=len(self.token_ids))

    @property
    def lora_name(self) -> str | None:
        return self.lora.name if self.lora is not None else None

    async def relay(
        self,
        decode: WorkerHandle,
        decode_request: worker_pb2.DecodeRequest,
        *,
        lead: generation_pb2.GenerateResponse | None = None,
        queued_tokens: int = 0,
        first_piece_by: float | None = None,
        on_first_piece: Callable[[worker_pb2.DecodeResponse], None] | None = None,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Relay ``decode_request``'s Decode on ``decode`` to the client, to its end or until the worker fails it
        UNAVAILABLE (``failure``: the worker is marked unhealthy and added to ``failed``; nothing is raised).

        ``lead``: a response sent as soon as the call is open (the prefill worker's first token), so the decode
        worker takes the KV while it travels. ``queued_tokens``: prompt tokens the worker computes before its
        first piece, counted as queued work there until then. ``first_piece_by``: the ``time.monotonic()`` by
        which the first piece must come, else ``TimeoutError``. ``on_first_piece`` sees the first piece before it
        is relayed. Any other error of the call propagates.
        """
        self.received, self.failure = False, None
        self.metrics.routed("decode", decode.worker_id)
        call = decode.stub.Decode(decode_request, timeout=self.time_remaining())
        pieces = call.__aiter__()
        with Inflight(decode, queued_tokens) as inflight:
            try:
                if lead is not None:
                    yield lead
                while True:
                    try:
                        piece = await self._next_piece(pieces, None if self.received else first_piece_by)
                    except StopAsyncIteration:
                        return
                    if not self.received:
                        self.received = True
                        inflight.computed()
                        if on_first_piece is not None:
                            on_first_piece(piece)
                    self.generated.extend(piece.token_ids)
                    self.finished = self.finished or piece.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
                    yield relayed_response(piece, self.request_id, self.usage)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                # Crashed or its engine died: out of rotation now, not at the next load poll, so requests
                # arriving meanwhile go to the other decode workers.
                decode.healthy = False
                self.failed.add(decode.address)
                self.failure = error
            finally:
                if not self.finished:
                    call.cancel()  # stops the worker's request; a no-op once the call has ended

    @staticmethod
    async def _next_piece(pieces: AsyncIterator[worker_pb2.DecodeResponse], by: float | None
                          ) -> worker_pb2.DecodeResponse:
        if by is None:
            return await anext(pieces)
        return await asyncio.wait_for(anext(pieces), max(0.0, by - time.monotonic()))


def relayed_response(piece: worker_pb2.DecodeResponse, request_id: str, usage: generation_pb2.Usage
                     ) -> generation_pb2.GenerateResponse:
    """A decode worker's piece as the client's response; the last carries ``usage``, counted here."""
    usage.completion_tokens += len(piece.token_ids)
    response = generation_pb2.GenerateResponse(
        request_id=request_id, token_ids=piece.token_ids, text=piece.text, logprobs=piece.logprobs
    )
    if piece.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
        response.finish_reason = piece.finish_reason
        usage.spec_decode_drafts = piece.spec_decode_drafts
        usage.spec_decode_draft_tokens = piece.spec_decode_draft_tokens
        usage.spec_decode_accepted_tokens = piece.spec_decode_accepted_tokens
        response.usage.CopyFrom(usage)
    return response
