from __future__ import annotations

import dataclasses

import pytest
from redis.asyncio import Redis

from pdserve.cluster_index import IndexUnavailable, KeySpace, WorkerInfo, WorkerRegistry, WorkerStatus, connect
from tests.cluster_index.helpers import make_worker
from tests.support.waiting import wait_until


@pytest.mark.asyncio
async def test_registered_worker_is_live_with_its_fields(redis_client: Redis, prefix: str) -> None:
    registry = WorkerRegistry(redis_client, prefix, ttl_s=5.0)
    worker = make_worker("p0", "prefill", epoch=1_700_000_000_000_000_001)
    await registry.register(worker)
    assert await registry.live_workers() == [worker]
    assert await registry.live_statuses() == [WorkerStatus(info=worker, load={})]
    ttl_ms = await redis_client.pttl(KeySpace(prefix).worker("p0"))
    assert 4000 < ttl_ms <= 5000


@pytest.mark.asyncio
async def test_heartbeat_stores_load_snapshot_and_refreshes_ttl(redis_client: Redis, prefix: str) -> None:
    registry = WorkerRegistry(redis_client, prefix, ttl_s=1.0)
    worker = make_worker("d0", "decode")
    unrefreshed = make_worker("d1", "decode")  # registered with it, never heartbeaten: shows when its TTL is over
    await registry.register(worker)
    await registry.register(unrefreshed)
    key = KeySpace(prefix).worker("d0")
    # Half the TTL gone by Redis's clock: the heartbeat comes well before the entry would expire.
    await wait_until(lambda: redis_client.pttl(key), "half the TTL to pass", until=lambda ttl_ms: ttl_ms < 500)
    load = {"num_running": 3, "num_free_blocks": 120, "num_queued_tokens": 4096}
    assert await registry.heartbeat(worker, load) is True
    # Once the entry registered with it has expired: alive only thanks to the heartbeat.
    await wait_until(registry.live_workers, "the unrefreshed entry to expire",
                     until=lambda live: unrefreshed not in live)
    assert await registry.live_statuses() == [WorkerStatus(info=worker, load=load)]
    # A heartbeat without a snapshot keeps the last one.
    assert await registry.heartbeat(worker) is True
    assert (await registry.live_statuses())[0].load == load


@pytest.mark.asyncio
async def test_worker_expires_after_ttl_and_is_pruned_from_the_set(redis_client: Redis, prefix: str) -> None:
    registry = WorkerRegistry(redis_client, prefix, ttl_s=0.3)
    worker = make_worker("p0")
    await registry.register(worker)
    assert await registry.live_workers() == [worker]
    await wait_until(registry.live_workers, "the entry to expire", until=lambda live: live == [])
    assert await registry.live_workers() == []
    assert await redis_client.smembers(KeySpace(prefix).workers) == set()
    # The next heartbeat re-registers and reports that the entry had vanished.
    assert await registry.heartbeat(worker) is False
    assert await registry.live_workers() == [worker]


@pytest.mark.asyncio
async def test_live_workers_filters_by_role_sorted_by_id(redis_client: Redis, prefix: str) -> None:
    registry = WorkerRegistry(redis_client, prefix)
    prefill = make_worker("p0", "prefill")
    decode_b = make_worker("d1", "decode")
    decode_a = make_worker("d0", "decode")
    for worker in (prefill, decode_b, decode_a):
        await registry.register(worker)
    assert await registry.live_workers("decode") == [decode_a, decode_b]
    assert await registry.live_workers("prefill") == [prefill]
    assert await registry.live_workers() == [decode_a, decode_b, prefill]


@pytest.mark.asyncio
async def test_deregister_removes_only_the_same_epoch(redis_client: Redis, prefix: str) -> None:
    registry = WorkerRegistry(redis_client, prefix)
    restarted = make_worker("p0", epoch=2)
    await registry.register(restarted)
    # The previous process shutting down late must not remove its successor.
    assert await registry.deregister(dataclasses.replace(restarted, epoch=1)) is False
    assert await registry.live_workers() == [restarted]
    assert await registry.deregister(restarted) is True
    assert await registry.live_workers() == []
    assert [key async for key in redis_client.scan_iter(match=f"{prefix}:*")] == []


@pytest.mark.asyncio
async def test_registry_keys_stay_under_the_prefix(redis_client: Redis, prefix: str) -> None:
    registry = WorkerRegistry(redis_client, prefix)
    await registry.register(make_worker("p0"))
    keys = {key.decode() async for key in redis_client.scan_iter(match=f"{prefix}:*")}
    assert keys == {f"{prefix}:workers", f"{prefix}:worker:p0"}


@pytest.mark.asyncio
async def test_registry_raises_index_unavailable_when_redis_is_down(dead_port: int) -> None:
    client = connect(f"redis://127.0.0.1:{dead_port}/0")
    try:
        registry = WorkerRegistry(client, "pdserve-test-unreachable")
        with pytest.raises(IndexUnavailable, match="register p0 failed: ConnectionError"):
            await registry.register(make_worker("p0"))
        with pytest.raises(IndexUnavailable):
            await registry.live_workers()
    finally:
        await client.aclose()


def test_worker_info_rejects_unknown_role_and_bad_block_size() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        WorkerInfo("w", "router", "h:1", 1, "m", 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        WorkerInfo("w", "decode", "h:1", 1, "m", 0)


def test_key_prefix_rejects_glob_characters() -> None:
    with pytest.raises(ValueError, match="invalid key prefix"):
        KeySpace("pdserve*")
