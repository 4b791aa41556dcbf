"""Fixtures: a client of the real Redis at 127.0.0.1:6379 under a unique key prefix, a dead port, a relay."""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from pdserve.cluster_index import connect
from tests.cluster_index.helpers import REDIS_URL
from tests.cluster_index.redis_proxy import RedisProxy

@pytest_asyncio.fixture
async def redis_client() -> AsyncIterator[Redis]:
    client = connect(REDIS_URL)
    try:
        await client.ping()
    except Exception as error:  # noqa: BLE001 - any failure means "no server to test against"
        await client.aclose()
        pytest.skip(f"no Redis server at {REDIS_URL}: {error}")
    try:
        yield client
    finally:
        await client.aclose()


@pytest_asyncio.fixture
async def prefix(redis_client: Redis) -> AsyncIterator[str]:
    """A namespace of this test's own; only its keys are deleted afterwards (the server is shared)."""
    prefix = f"pdserve-test-{uuid.uuid4().hex}"
    try:
        yield prefix
    finally:
        keys = [key async for key in redis_client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await redis_client.delete(*keys)


@pytest.fixture
def dead_port() -> int:
    """A loopback port nothing listens on (bound to learn a free one, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest_asyncio.fixture
async def redis_proxy(redis_client: Redis) -> AsyncIterator[RedisProxy]:
    proxy = RedisProxy()
    await proxy.start()
    try:
        yield proxy
    finally:
        if proxy.is_running:
            await proxy.stop()

