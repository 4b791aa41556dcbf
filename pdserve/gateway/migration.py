"""Streams that outlive their decode worker: a request whose worker fails mid-stream continues on another.

When a decode worker becomes unreachable (killed, its engine dead, its
connection gone) after the client has received tokens, the gateway sends the
request to another decode worker (or a colocated one) with the prompt and
every token already sent (``DecodeRequest.resume_token_ids``). That worker
computes them (reusing what its prefix cache holds), continues after them with
the request's sampling state where it stood (a seeded request's random stream
is a function of its seed and the token's position), and streams only what
comes after: the client sees a pause, no error, no repeated or missing token.
Usage counts the prompt once. At most ``max_migrations`` moves per request,
and at most ``timeout_s`` from the first failure until a new worker's first
token (within the client's deadline); past either the stream ends with
UNAVAILABLE saying why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from pdserve.gateway.router import NoWorkerAvailable, Router
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.errors import Unavailable
from pdserve.service_common.metrics import GatewayMetrics

log = logging.getLogger(__name__)

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


def resume_request(
    request: generation_pb2.GenerateRequest, request_id: str, token_ids: list[int], generated: list[int],
    lora: worker_pb2.LoRAAdapter | None,
) -> worker_pb2.DecodeRequest:
    """The Decode that continues ``request`` after ``generated`` on another worker (computed there, no handoff)."""
    params = generation_pb2.SamplingParams()
    params.CopyFrom(request.sampling_params)
    params.ClearField("prompt_logprobs")  # delivered with the first token already
    return worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                                    lora=lora, resume_token_ids=generated)


async def migrate(
    router: Router, metrics: GatewayMetrics, request: generation_pb2.GenerateRequest, request_id: str,
    token_ids: list[int], generated: list[int], lora: worker_pb2.LoRAAdapter | None, failed: set[str],
    time_remaining: Callable[[], float | None], policy: MigrationPolicy, cause: str,
) -> AsyncIterator[worker_pb2.DecodeResponse]:
    """The rest of a stream whose decode worker (an address in ``failed``) failed after the client received
    ``generated``: pieces from the workers it moves to, ``generated`` extended as they come. Raises
    ``Unavailable`` saying why once ``policy``'s moves have failed, its time has passed without a new worker's
    token, or no decode worker is left."""
    # The time paused so far counts against policy.timeout_s: each pause runs from a failure to the next token.
    budget_s = policy.timeout_s
    paused_since: float | None = time.monotonic()
    max_migrations = policy.max_migrations
    for migration in range(1, max_migrations + 1):
        try:
            decode = router.choose_decode(lora.name if lora is not None else None, exclude=failed)
        except NoWorkerAvailable as error:
            metrics.migrated(cause, "no_worker")
            raise Unavailable(f"the decode worker of this stream failed after {len(generated)} tokens and no "
                              f"other decode worker is available to continue it ({error})") from error
        log.warning("moving %s to decode worker %s after %d tokens (migration %d of at most %d)",
                    request_id, decode.address, len(generated), migration, max_migrations)
        metrics.routed("decode", decode.worker_id)
        call = decode.stub.Decode(resume_request(request, request_id, token_ids, generated, lora),
                                  timeout=time_remaining())
        decode.inflight_requests += 1
        pieces = call.__aiter__()
        try:
            try:
                waited_s = time.monotonic() - paused_since
                piece = await asyncio.wait_for(anext(pieces), max(0.0, budget_s - waited_s))
            except asyncio.TimeoutError:
                metrics.migrated(cause, "timed_out")
                raise Unavailable(f"the decode worker of this stream failed after {len(generated)} tokens and it "
                                  f"was not resumed within --migration-timeout {policy.timeout_s:g} s") from None
            except StopAsyncIteration:
                return
            pause_s = time.monotonic() - paused_since
            budget_s -= pause_s
            metrics.migrated(cause, "resumed", pause_s)
            paused_since = None
            while True:
                generated.extend(piece.token_ids)
                yield piece
                try:
                    piece = await anext(pieces)
                except StopAsyncIteration:
                    return
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            decode.healthy = False
            failed.add(decode.address)
            if paused_since is None:  # it had resumed: a new pause starts now
                paused_since = time.monotonic()
            cause = "decode_unavailable"
        finally:
            decode.inflight_requests -= 1
            call.cancel()  # a no-op once the stream ended; stops the request there otherwise
    metrics.migrated(cause, "gave_up")
    raise Unavailable(f"the decode workers of this stream failed {max_migrations + 1} times "
                      f"(--max-migrations {max_migrations}); it ends after {len(generated)} tokens")


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

