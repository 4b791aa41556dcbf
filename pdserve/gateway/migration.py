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

import contextlib
import logging
import time
from collections.abc import AsyncIterator

from pdserve.gateway.decode_stream import DecodeStream
from pdserve.gateway.router import NoWorkerAvailable
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.errors import Unavailable

log = logging.getLogger(__name__)

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


async def migrate(stream: DecodeStream, cause: str = "decode_unavailable"
                  ) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """The rest of ``stream`` after its decode worker (an address in ``stream.failed``) failed: relayed from the
    workers it moves to, after the tokens the client has (``stream.generated``, extended as they come). Raises
    ``Unavailable`` saying why once the stream's ``MigrationPolicy`` allows no move or its moves have failed, its
    time has passed without a new worker's token, or no decode worker is left."""
    policy, metrics = stream.migration, stream.metrics
    max_migrations = policy.max_migrations
    if max_migrations < 1:
        raise Unavailable(f"the decode worker of this stream failed after {len(stream.generated)} tokens "
                          "(--max-migrations 0: streams are not moved)")
    # The time paused so far counts against policy.timeout_s: each pause runs from a failure to the next token.
    budget_s = policy.timeout_s
    paused, paused_since = True, time.monotonic()

    def resumed(piece: worker_pb2.DecodeResponse) -> None:
        nonlocal budget_s, paused
        pause_s = time.monotonic() - paused_since
        budget_s -= pause_s
        metrics.migrated(cause, "resumed", pause_s)
        paused = False

    for migration in range(1, max_migrations + 1):
        try:
            decode = stream.router.choose_decode(stream.lora_name, exclude=stream.failed)
        except NoWorkerAvailable as error:
            metrics.migrated(cause, "no_worker")
            raise Unavailable(f"the decode worker of this stream failed after {len(stream.generated)} tokens and "
                              f"no other decode worker is available to continue it ({error})") from error
        log.warning("moving %s to decode worker %s after %d tokens (migration %d of at most %d)",
                    stream.request_id, decode.address, len(stream.generated), migration, max_migrations)
        request = resume_request(stream.request, stream.request_id, stream.token_ids, stream.generated, stream.lora)
        relayed = stream.relay(decode, request, first_piece_by=paused_since + budget_s, on_first_piece=resumed)
        try:
            async with contextlib.aclosing(relayed):
                async for response in relayed:
                    yield response
        except TimeoutError:
            metrics.migrated(cause, "timed_out")
            raise Unavailable(f"the decode worker of this stream failed after {len(stream.generated)} tokens and "
                              f"it was not resumed within --migration-timeout {policy.timeout_s:g} s") from None
        if stream.failure is None:
            return
        if not paused:  # it had resumed: a new pause starts now
            paused, paused_since = True, time.monotonic()
        cause = "decode_unavailable"
    metrics.migrated(cause, "gave_up")
    raise Unavailable(f"the decode workers of this stream failed {max_migrations + 1} times "
                      f"(--max-migrations {max_migrations}); it ends after {len(stream.generated)} tokens")
