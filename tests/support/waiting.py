"""The one way a test waits: poll for the condition it needs, with a deadline generous enough for a loaded machine.

A fixed sleep is either too short on a busy machine (the test flakes) or longer than needed
everywhere else (the suite crawls); a poll returns as soon as the condition holds.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# Long enough for two shared cores under four other test runs; a passing test never waits it out.
DEFAULT_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.02


def _timed_out(message: str, timeout_s: float, last: object) -> AssertionError:
    return AssertionError(f"timed out after {timeout_s:g} s waiting for {message}; last value: {last!r}")


async def wait_until(
    probe: Callable[[], T | Awaitable[T]],
    message: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    until: Callable[[T], object] = bool,
    interval_s: float = POLL_INTERVAL_S,
) -> T:
    """Call ``probe`` (a plain function or a coroutine function) until ``until`` holds for its value; return that value.

    ``until`` defaults to truthiness, so ``probe`` can be the condition itself. After
    ``timeout_s`` it raises ``AssertionError`` naming ``message`` and the last value seen.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if until(value):
            return value  # type: ignore[return-value]
        if loop.time() > deadline:
            raise _timed_out(message, timeout_s, value)
        await asyncio.sleep(interval_s)


def wait_until_sync(
    probe: Callable[[], T],
    message: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    until: Callable[[T], object] = bool,
    interval_s: float = POLL_INTERVAL_S,
) -> T:
    """``wait_until`` for code outside an event loop (a thread, a synchronous fixture)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if until(value):
            return value
        if time.monotonic() > deadline:
            raise _timed_out(message, timeout_s, value)
        time.sleep(interval_s)
