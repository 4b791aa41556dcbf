from __future__ import annotations

import asyncio
import logging
import time

import pytest
from redis.asyncio import Redis

from pdserve.cluster_index import PrefixIndexLookup, PrefixIndexPublisher, connect
from tests.cluster_index.helpers import make_worker, prompt_hashes
from tests.cluster_index.redis_proxy import RedisProxy


@pytest.mark.asyncio
async def test_lookup_returns_empty_fast_and_logs_once_when_redis_is_down(
    dead_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cluster_index")
    client = connect(f"redis://127.0.0.1:{dead_port}/0")
    try:
        lookup = PrefixIndexLookup(client, "pdserve-test-unreachable")
        started = time.monotonic()
        assert await lookup.longest_prefix(prompt_hashes(100), {"A": 1}) == {}
        assert await lookup.longest_prefix(prompt_hashes(3), {"A": 1}) == {}
        assert time.monotonic() - started < 1.0
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            "prefix index lookup: Redis unavailable (ConnectionError: Error 111 connecting to "
            f"127.0.0.1:{dead_port}. Connect call failed ('127.0.0.1', {dead_port}).); continuing without the index"
        ]
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_lookup_gives_up_on_a_server_that_accepts_but_never_answers() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read()  # read until the client gives up, reply nothing

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = connect(f"redis://127.0.0.1:{port}/0", socket_timeout_s=5.0)
    try:
        lookup = PrefixIndexLookup(client, "pdserve-test-silent", timeout_s=0.3)
        started = time.monotonic()
        assert await lookup.longest_prefix(prompt_hashes(4), {"A": 1}) == {}
        assert time.monotonic() - started < 1.0
    finally:
        await client.aclose()
        server.close()
        for writer in accepted:
            writer.transport.abort()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_publisher_counts_dropped_events_without_raising(dead_port: int) -> None:
    client = connect(f"redis://127.0.0.1:{dead_port}/0")
    try:
        publisher = PrefixIndexPublisher(client, "pdserve-test-unreachable", make_worker("A"))
        hashes = prompt_hashes(3)
        assert await publisher.reset() is False
        assert await publisher.publish(hashes[:2], [hashes[2]]) is False
        assert await publisher.publish(removed_hashes=hashes[:1]) is False
        assert (publisher.in_sync, publisher.num_dropped_events) == (False, 4)
        assert await publisher.resync(hashes) is False
        assert await publisher.clear() is False
        assert (publisher.in_sync, publisher.num_dropped_events) == (False, 4)
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_resync_after_outage_restores_exact_prefix_counts(
    redis_client: Redis, prefix: str, redis_proxy: RedisProxy
) -> None:
    hashes = prompt_hashes(6)
    proxied = connect(redis_proxy.url)
    try:
        publisher = PrefixIndexPublisher(proxied, prefix, make_worker("A", epoch=7))
        proxied_lookup = PrefixIndexLookup(proxied, prefix)
        assert await publisher.publish(hashes[:3]) is True

        await redis_proxy.stop()
        # Evicts block 2 and caches 3..5 while Redis is unreachable.
        assert await publisher.publish(hashes[3:], [hashes[2]]) is False
        assert await proxied_lookup.longest_prefix(hashes, {"A": 7}) == {}
        assert (publisher.in_sync, publisher.num_dropped_events) == (False, 4)

        await redis_proxy.start()
        cached_now = [hashes[0], hashes[1], hashes[3], hashes[4], hashes[5]]
        assert await publisher.resync(cached_now) is True
        assert (publisher.in_sync, publisher.num_dropped_events) == (True, 0)
        lookup = PrefixIndexLookup(redis_client, prefix)
        assert await lookup.longest_prefix(hashes, {"A": 7}) == {"A": 2}
        assert await lookup.longest_prefix(hashes[:2], {"A": 7}) == {"A": 2}
        assert await proxied_lookup.longest_prefix(hashes, {"A": 7}) == {"A": 2}
    finally:
        await proxied.aclose()
