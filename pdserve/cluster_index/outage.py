"""Logging a Redis outage once when it starts and once when it ends, not once per failed call."""

from __future__ import annotations

import logging


class OutageLog:
    """Tracks whether Redis is down for one component and logs only the transitions.

    A gateway makes hundreds of lookups a second; without this, a Redis outage
    would flood the log with the same warning.
    """

    def __init__(self, logger: logging.Logger, component: str) -> None:
        self._logger = logger
        self._component = component
        self._down = False

    @property
    def down(self) -> bool:
        return self._down

    def failed(self, error: BaseException) -> bool:
        """Record a failed call; True (and a warning) when this starts an outage."""
        if self._down:
            return False
        self._down = True
        self._logger.warning("%s: Redis unavailable (%s: %s); continuing without the index",
                             self._component, type(error).__name__, error)
        return True

    def recovered(self) -> bool:
        """Record a successful call; True (and an info line) when this ends an outage."""
        if not self._down:
            return False
        self._down = False
        self._logger.info("%s: Redis reachable again", self._component)
        return True
