from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import SSLConnection

from pdserve.cluster_index import cancel_and_wait, connect
from tests.cluster_index.helpers import REDIS_URL
from tests.support.waiting import wait_until


@pytest.mark.asyncio
async def test_connect_reads_acl_user_password_and_db_from_url_and_sets_short_timeouts() -> None:
    client = connect(
        "redis://alice:p%40ss@127.0.0.1:6379/3",
        socket_connect_timeout_s=0.25,
        socket_timeout_s=0.75,
        health_check_interval_s=5.0,
    )
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("alice", "p@ss", 3)
        assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"]) == (0.25, 0.75)
        assert kwargs["health_check_interval"] == 5.0
        assert kwargs["retry"].get_retries() == 0
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_connect_rediss_uses_tls_connections() -> None:
    client = connect("rediss://:secret@redis.example:6380/0")
    try:
        assert client.connection_pool.connection_class is SSLConnection
        assert client.connection_pool.connection_kwargs["password"] == "secret"
    finally:
        await client.aclose()


def test_connect_rejects_other_schemes() -> None:
    with pytest.raises(ValueError, match="unsupported Redis URL scheme 'http'"):
        connect("http://127.0.0.1:6379")


@pytest.mark.asyncio
async def test_connect_reaches_the_server(redis_client: object) -> None:
    client = connect(REDIS_URL)
    try:
        assert await client.ping() is True
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_cancel_and_wait_stops_a_redis_loop_even_when_the_client_swallows_the_cancellation(
    redis_client: Redis,
) -> None:
    # redis-py 8.1 swallows about half the cancellations that land inside a command, so
    # cancel() then await would leave several of these loops running for ever.
    for trial in range(20):
        pings = 0

        async def ping_for_ever() -> None:
            nonlocal pings
            while True:
                await redis_client.ping()
                pings += 1

        task = asyncio.create_task(ping_for_ever())
        # Cancelled at a different point each time, always with a ping in flight.
        await wait_until(lambda: pings >= 1 + trial % 5, "the loop to be pinging")
        await asyncio.wait_for(cancel_and_wait(task), timeout=10)
        assert task.cancelled(), trial
