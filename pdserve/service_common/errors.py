"""Exceptions become gRPC status codes here, in one place, with a message a user can act on."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc

from pdserve.engine.types.errors import EngineDeadError

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """A worker or peer this request needs cannot be reached or has no capacity."""


class Overloaded(RuntimeError):
    """Admitting this request would exceed a configured queue limit: refused at once, not queued."""


_MAPPED = (ValueError, KeyError, EngineDeadError, Unavailable, Overloaded, ConnectionError, TimeoutError)


class Unparsable:
    """Stands in for a request whose bytes do not parse, so the handler can answer INVALID_ARGUMENT.

    grpc's own deserialization failure ends the call with UNKNOWN before any
    handler runs; ``Server.add_servicer`` installs deserializers that return this instead.
    """

    def __init__(self, error: Exception) -> None:
        self.error = error


async def _reject_unparsable(request: object, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Unparsable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not parse: {request.error}")


def status_for(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, KeyError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, (EngineDeadError, Unavailable, ConnectionError)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(error, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL


def _message(error: BaseException) -> str:
    # KeyError's str() adds quotes around its argument.
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error) or type(error).__name__


async def _abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    code = status_for(error)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error in RPC handler", exc_info=error)
    await context.abort(code, _message(error))


def grpc_errors(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Map exceptions raised by a unary or server-streaming grpc.aio handler to statuses.

    ``grpc.aio.AioRpcError`` from a downstream call keeps its own status and
    details, so a worker's INVALID_ARGUMENT reaches the client unchanged.
    """
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _reject_unparsable(request, context)
            try:
                async for item in handler(self, request, context):
                    yield item
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "")
            except _MAPPED as error:
                await _abort(context, error)

        return stream_wrapper

    @functools.wraps(handler)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _reject_unparsable(request, context)
        try:
            return await handler(self, request, context)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
        except _MAPPED as error:
            await _abort(context, error)

    return unary_wrapper
