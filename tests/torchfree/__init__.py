"""The gateway and the client without torch: import hygiene, a torch-free gateway process, the client package."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from tests.support.cluster import ClusterOptions, InProcessCluster


@asynccontextmanager
async def workers(checkpoint: Path) -> AsyncIterator[tuple[str, str]]:
    """A prefill and a decode worker in this process (loopback, no Redis); yields their addresses.

    The gateway under test runs elsewhere: in another process, or started by the test.
    """
    async with InProcessCluster(checkpoint, ClusterOptions(num_kv_blocks=64, gateway=False)) as cluster:
        yield cluster.prefill_addresses[0], cluster.decode_addresses[0]
