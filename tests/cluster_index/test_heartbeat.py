from __future__ import annotations

import asyncio
import logging

import pytest
from redis.asyncio import Redis

from cluster_index import Heartbeat, KeySpace, WorkerRegistry, WorkerStatus, connect
from tests.cluster_index.helpers import make_worker
from tests.cluster_index.redis_proxy import RedisProxy


async def _wait_for(condition: object, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_heartbeat_keeps_worker_live_past_ttl_and_stop_deregisters(redis_client: Redis, prefix: str) -> None:
    registry = WorkerRegistry(redis_client, prefix, ttl_s=0.3)
    worker = make_worker("d0", "decode")
    heartbeat = Heartbeat(registry, worker, load_provider=lambda: {"num_running": 2})
    heartbeat.start()
    try:
        await asyncio.sleep(0.6)  # twice the TTL
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

    heartbeat = Heartbeat(WorkerRegistry(proxied, prefix, ttl_s=0.3), worker, on_reregistered=on_reregistered)
    direct = WorkerRegistry(redis_client, prefix, ttl_s=0.3)
    heartbeat.start()
    try:
        await _wait_for(lambda: heartbeat.num_beats >= 1)
        await redis_proxy.stop()
        await asyncio.sleep(0.5)  # several failed beats; the entry expires meanwhile
        assert await direct.live_workers() == []
        assert heartbeat.registered is False
        outage_warnings = [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
        assert len(outage_warnings) == 1
        assert outage_warnings[0].levelno == logging.WARNING

        beats_before = heartbeat.num_beats
        await redis_proxy.start()
        await _wait_for(lambda: heartbeat.num_beats > beats_before)
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
        await _wait_for(lambda: heartbeat.num_beats >= 1)
        assert reregistered == []  # the first beat is a registration, not a re-registration
        # As after a Redis restart without persistence.
        await redis_client.delete(KeySpace(prefix).worker("p0"))
        await _wait_for(lambda: reregistered == [1])
        assert await registry.live_workers() == [worker]
    finally:
        await heartbeat.stop()
