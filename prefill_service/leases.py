"""Leases on held KV: blocks stay pinned until the decode side releases them or time runs out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LeaseTable:
    """One timer per held request; ``release`` ends a lease early, expiry calls ``on_end`` too."""

    def __init__(self, lease_s: float, on_end: Callable[[str], None]) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.lease_s = lease_s
        self._on_end = on_end
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.num_expired = 0

    def grant(self, request_id: str) -> int:
        """Start a lease; returns its deadline in Unix milliseconds."""
        loop = asyncio.get_running_loop()
        self._timers[request_id] = loop.call_later(self.lease_s, self._expire, request_id)
        return int((time.time() + self.lease_s) * 1000)

    def release(self, request_id: str) -> bool:
        timer = self._timers.pop(request_id, None)
        if timer is None:
            return False
        timer.cancel()
        self._on_end(request_id)
        return True

    def release_all(self) -> None:
        for request_id in list(self._timers):
            self.release(request_id)

    def __len__(self) -> int:
        return len(self._timers)

    def _expire(self, request_id: str) -> None:
        if self._timers.pop(request_id, None) is not None:
            self.num_expired += 1
            self._on_end(request_id)
