"""A worker's heartbeat: keeps its registry entry alive, through Redis outages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdserve.cluster_index.connection import IndexUnavailable, cancel_and_wait
from pdserve.cluster_index.outage import OutageLog
from pdserve.cluster_index.registry import LoadSnapshot, WorkerInfo, WorkerRegistry

logger = logging.getLogger(__name__)

LoadProvider = Callable[[], LoadSnapshot | None]
ReregisteredCallback = Callable[[], Awaitable[None]]


class Heartbeat:
    """Heartbeats ``info`` every ``ttl_s / 3`` in an asyncio task until stopped.

    Redis failures never end the task: it logs a warning once per outage and
    keeps beating, and since each beat rewrites the whole entry, the first
    successful beat after an outage re-registers the worker. At that moment, and
    whenever a beat finds the entry had vanished (expired during a stall, lost
    with a Redis restart), ``on_reregistered`` runs: the worker's hook to
    resync its prefix-index entries, which may be gone or stale as well. If the
    hook raises, it is retried on the next beat.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        info: WorkerInfo,
        *,
        load_provider: LoadProvider | None = None,
        on_reregistered: ReregisteredCallback | None = None,
        interval_s: float | None = None,
    ) -> None:
        self._registry = registry
        self._info = info
        self._load_provider = load_provider
        self._on_reregistered = on_reregistered
        self._interval_s = interval_s if interval_s is not None else registry.ttl_s / 3
        if not self._interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self._interval_s}")
        self._outage = OutageLog(logger, f"heartbeat of worker {info.worker_id}")
        self._task: asyncio.Task[None] | None = None
        self._num_beats = 0

    @property
    def registered(self) -> bool:
        """Whether the last beat reached Redis (False before the first one)."""
        return self._num_beats > 0 and not self._outage.down

    @property
    def num_beats(self) -> int:
        """Successful beats so far."""
        return self._num_beats

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("heartbeat already started")
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"heartbeat-{self._info.worker_id}"
        )

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop beating and, by default, remove the entry now rather than after its TTL."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if deregister:
            try:
                await self._registry.deregister(self._info)
            except IndexUnavailable as error:
                # The entry expires on its own within one TTL.
                logger.warning("could not deregister worker %s: %s", self._info.worker_id, error)

    async def _run(self) -> None:
        # The very first successful beat is a registration, not a re-registration.
        pending_callback = False
        while True:
            try:
                existed = await self._registry.heartbeat(self._info, self._load())
            except IndexUnavailable as error:
                self._outage.failed(error)
            else:
                recovered = self._outage.recovered()
                if recovered or (not existed and self._num_beats > 0):
                    pending_callback = True
                self._num_beats += 1
                if pending_callback:
                    pending_callback = not await self._run_callback()
            await asyncio.sleep(self._interval_s)

    def _load(self) -> LoadSnapshot | None:
        if self._load_provider is None:
            return None
        try:
            return self._load_provider()
        except Exception:
            # A broken load probe must not kill liveness: beat without a snapshot.
            logger.exception("load provider of worker %s failed", self._info.worker_id)
            return None

    async def _run_callback(self) -> bool:
        if self._on_reregistered is None:
            return True
        try:
            await self._on_reregistered()
        except Exception:
            logger.exception("on_reregistered hook of worker %s failed; retrying next beat", self._info.worker_id)
            return False
        return True
