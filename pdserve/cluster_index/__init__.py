"""What Redis holds for a pdserve cluster: the worker registry and the prefix-cache index.

Redis is an index, not the truth: entries carry TTLs and worker epochs, stale
ones are ignored and cleaned, and every caller keeps working while Redis is
down. Importable without torch (the gateway uses it).
"""

from __future__ import annotations

from pdserve.cluster_index.block_events import BlockChanges, BlockEventBatch
from pdserve.cluster_index.connection import DEFAULT_REDIS_URL, IndexUnavailable, cancel_and_wait, connect
from pdserve.cluster_index.heartbeat import Heartbeat
from pdserve.cluster_index.keys import DEFAULT_PREFIX, KeySpace
from pdserve.cluster_index.prefix_index import PrefixIndexLookup, PrefixIndexPublisher
from pdserve.cluster_index.registry import WORKER_ROLES, WorkerInfo, WorkerRegistry, WorkerRole, WorkerStatus

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_REDIS_URL",
    "WORKER_ROLES",
    "BlockChanges",
    "BlockEventBatch",
    "Heartbeat",
    "IndexUnavailable",
    "KeySpace",
    "PrefixIndexLookup",
    "PrefixIndexPublisher",
    "WorkerInfo",
    "WorkerRegistry",
    "WorkerRole",
    "WorkerStatus",
    "cancel_and_wait",
    "connect",
]
