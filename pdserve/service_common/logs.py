"""Log lines that carry the id of the request they concern, as text or JSON."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s request_id=%(request_id)s: %(message)s"
LOG_FORMATS = ("text", "json")
NO_REQUEST = "-"

# Set while a request is handled. grpc.aio runs every RPC in its own task, and a
# task copies the context, so one request's id never leaks into another's lines.
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_id", default=NO_REQUEST)


def current_request_id() -> str:
    return _request_id.get()


@contextlib.contextmanager
def request_id_context(request_id: str) -> Iterator[None]:
    """Tag every record logged inside the block, in this task, with ``request_id``."""
    token = _request_id.set(request_id or NO_REQUEST)
    try:
        yield
    finally:
        try:
            _request_id.reset(token)
        except ValueError:
            pass  # a stream closed from another task (at garbage collection): that context is gone anyway


def with_request_id(request_id_of: Callable[[Any], str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a unary or server-streaming grpc.aio handler to log under ``request_id_of(request)``."""

    def decorate(handler: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(handler):

            @functools.wraps(handler)
            async def stream_wrapper(self: Any, request: Any, context: Any) -> Any:
                with request_id_context(request_id_of(request)):
                    async for item in handler(self, request, context):
                        yield item

            return stream_wrapper

        @functools.wraps(handler)
        async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
            with request_id_context(request_id_of(request)):
                return await handler(self, request, context)

        return unary_wrapper

    return decorate


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (``-`` outside a request); attach it to handlers, so every logger's records get it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request_id, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", NO_REQUEST),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, log_format: str = "text") -> None:
    """The process's root handler: request ids on every line, as ``text`` or ``json``."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
