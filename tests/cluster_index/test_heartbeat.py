from __future__ import annotations

import logging

import pytest
from redis.asyncio import Redis

from pdserve.cluster_index import Heartbeat, KeySpace, WorkerRegistry, WorkerStatus, connect
from tests.cluster_index.helpers import make_worker
from tests.cluster_index.redis_proxy import RedisProxy
from tests.support.waiting import wait_until


def _count_attempts(registry: WorkerRegistry) -> list[None]:
    """One entry per heartbeat the registry is asked for, whether or not it reaches Redis."""
    attempts: list[None] = []
    heartbeat = registry.heartbeat

    async def counted(*args: object, **kwargs: object) -> bool:
        attempts.append(None)
        return await heartbeat(*args, **kwargs)  # type: ignore[arg-type]

    registry.heartbeat = counted  # type: ignore[method-assign]
    return attempts


@pytest.mark.asyncio
async def test_heartbeat_keeps_worker_live_past_ttl_and_stop_deregisters(redis_client: Redis, prefix: str) -> None:
    # Beats every 0.2 s: a stall of up to 0.4 s on a loaded machine does not let the entry expire.
    registry = WorkerRegistry(redis_client, prefix, ttl_s=0.6)
    worker = make_worker("d0", "decode")
    unrefreshed = make_worker("d1", "decode")  # shows when the first beat's TTL is over
    heartbeat = Heartbeat(registry, worker, load_provider=lambda: {"num_running": 2})
    heartbeat.start()
    try:
        await wait_until(lambda: heartbeat.num_beats >= 1, "the first beat")
        await registry.register(unrefreshed)
        # Past the first beat's TTL: alive only thanks to the later beats.
        await wait_until(registry.live_workers, "the unrefreshed entry to expire",
                         until=lambda live: unrefreshed not in live)
        assert await registry.live_statuses() == [WorkerStatus(info=worker, load={"num_running": 2})]
        assert heartbeat.registered is True
    finally:
        await heartbeat.stop()
    assert await registry.live_workers() == []


@pytest.mark.asyncio
async def test_heartbeat_survives_outage_logs_once_and_reregisters(
    redis_client: Redis, prefix: str, redis_proxy: RedisProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cluster_index")
    proxied = connect(redis_proxy.url)
    worker = make_worker("p0")
    reregistered: list[int] = []

    async def on_reregistered() -> None:
        reregistered.append(1)

    proxied_registry = WorkerRegistry(proxied, prefix, ttl_s=0.3)
    attempts = _count_attempts(proxied_registry)
    heartbeat = Heartbeat(proxied_registry, worker, on_reregistered=on_reregistered)
    direct = WorkerRegistry(redis_client, prefix, ttl_s=0.3)
    heartbeat.start()
    try:
        await wait_until(lambda: heartbeat.num_beats >= 1, "the first beat")
        await redis_proxy.stop()
        failed_from = len(attempts)
        # Several failed beats; the entry expires meanwhile.
        await wait_until(direct.live_workers, "the entry to expire", until=lambda live: live == [])
        await wait_until(lambda: len(attempts) >= failed_from + 3, "three failed beats")
        assert await direct.live_workers() == []
        assert heartbeat.registered is False
        outage_warnings = [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
        assert len(outage_warnings) == 1
        assert outage_warnings[0].levelno == logging.WARNING

        beats_before = heartbeat.num_beats
        await redis_proxy.start()
        await wait_until(lambda: heartbeat.num_beats > beats_before, "a beat after Redis returned")
        assert await direct.live_workers() == [worker]
        assert reregistered == [1]
    finally:
        await heartbeat.stop()
        await proxied.aclose()


@pytest.mark.asyncio
async def test_heartbeat_calls_hook_when_its_entry_vanished(redis_client: Redis, prefix: str) -> None:
    registry = WorkerRegistry(redis_client, prefix, ttl_s=0.3)
    worker = make_worker("p0")
    reregistered: list[int] = []

    async def on_reregistered() -> None:
        reregistered.append(1)

    heartbeat = Heartbeat(registry, worker, on_reregistered=on_reregistered)
    heartbeat.start()
    try:
        await wait_until(lambda: heartbeat.num_beats >= 1, "the first beat")
        assert reregistered == []  # the first beat is a registration, not a re-registration
        # As after a Redis restart without persistence.
        await redis_client.delete(KeySpace(prefix).worker("p0"))
        await wait_until(lambda: reregistered == [1], "the re-registration hook")
        assert await registry.live_workers() == [worker]
    finally:
        await heartbeat.stop()
