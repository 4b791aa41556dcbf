"""How pdserve reaches Redis, and what "Redis is unreachable" looks like to callers.

Redis is an index, not the truth: every caller must keep working when it is
down, so connections fail fast (short socket timeouts, no retry loop) instead of
stalling a request or the engine loop behind a dead server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# Everything a Redis call raises when the server is down, slow or refusing us.
# asyncio.TimeoutError covers asyncio.wait_for budgets around a call (it is the
# builtin TimeoutError, an OSError, from Python 3.11 on).
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)

_SCHEMES = ("redis", "rediss")


class IndexUnavailable(Exception):
    """Redis could not serve a cluster-index call; the caller falls back (load-only routing, retry later)."""


async def cancel_and_wait(task: asyncio.Task[object]) -> None:
    """Cancel a background task that calls Redis, and return once it has ended (whatever its outcome).

    redis-py's asyncio client (8.1) can swallow a cancellation that lands inside a
    command: the command returns or fails as if nothing happened, and a loop around it
    carries on, so one ``cancel()`` then ``await task`` may wait forever. Cancel again
    until the task is done.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.01)
    if not task.cancelled():
        task.exception()  # retrieved: a task that failed before it was stopped is not logged as unhandled


@contextlib.contextmanager
def translate_errors(action: str) -> Iterator[None]:
    """Re-raise any Redis failure inside the block as ``IndexUnavailable`` naming ``action``."""
    try:
        yield
    except UNAVAILABLE_ERRORS as error:
        raise IndexUnavailable(f"{action} failed: {type(error).__name__}: {error}") from error


def as_text(value: bytes | str) -> str:
    """Redis replies are bytes unless the client was built with ``decode_responses=True``."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def connect(
    url: str = DEFAULT_REDIS_URL,
    *,
    socket_connect_timeout_s: float = 0.5,
    socket_timeout_s: float = 0.5,
    health_check_interval_s: float = 10.0,
    retries: int = 0,
    max_connections: int | None = None,
) -> Redis:
    """An asyncio Redis client for ``url`` (``redis://`` or ``rediss://``, user and password allowed).

    No connection is made here: the first command connects. Query-string options
    in the URL override the keyword arguments (redis-py's rule).
    """
    scheme = urlsplit(url).scheme
    if scheme not in _SCHEMES:
        raise ValueError(f"unsupported Redis URL scheme {scheme!r} in {url!r}; use redis:// or rediss://")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    return Redis.from_url(
        url,
        socket_connect_timeout=socket_connect_timeout_s,
        socket_timeout=socket_timeout_s,
        health_check_interval=health_check_interval_s,
        # Explicit, because redis-py 8's Redis() default is 10 retries with
        # backoff (seconds of stalling per call against a dead server); the
        # callers here already treat a failure as "index unavailable".
        retry=Retry(NoBackoff(), retries),
        decode_responses=False,
        max_connections=max_connections,
    )
