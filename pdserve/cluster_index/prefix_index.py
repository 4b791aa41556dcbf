"""Prefix-cache index: which workers hold which KV blocks, written by workers, read by the gateway.

``{prefix}:blk:{hash_hex}`` maps ``worker_id -> epoch`` for every worker caching
the block; ``{prefix}:wblk:{worker_id}`` lists the hashes a worker published so
its entries can be dropped without scanning. An entry counts only while its
worker is live with the same epoch: a restarted worker's cache is empty no
matter what Redis still says. Such entries are ignored by lookups and deleted
lazily, and every key carries a generous TTL so a worker that vanished for good
does not leave keys behind forever.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from pdserve.cluster_index.block_events import BlockChanges
from pdserve.cluster_index.connection import UNAVAILABLE_ERRORS, as_text
from pdserve.cluster_index.keys import DEFAULT_PREFIX, KeySpace
from pdserve.cluster_index.outage import OutageLog
from pdserve.cluster_index.registry import WorkerInfo
from pdserve.engine.types.hashing import BlockHash

logger = logging.getLogger(__name__)

# Commands per pipeline when a worker rewrites all its entries: bounds the reply
# buffered per round trip and how long Redis is busy with one batch.
_CHUNK = 1000

# Drop one (block, worker) entry by epoch: mode 'same' drops it when the stored
# epoch equals ARGV[2] (clear at shutdown), 'other' when it differs (reset at
# start). The hash leaves the worker's set once the entry is gone. Returns 1
# when no entry of this worker remains for the block.
_DROP_ENTRY_LUA = """
local epoch = redis.call('HGET', KEYS[1], ARGV[1])
if epoch and ((ARGV[3] == 'same') == (epoch == ARGV[2])) then
  redis.call('HDEL', KEYS[1], ARGV[1])
  epoch = false
end
if not epoch then
  redis.call('SREM', KEYS[2], ARGV[4])
  return 1
end
return 0
"""

# Lazy cleanup from the lookup side. The gateway's view of who is live may lag
# (a worker that registered a moment ago), so the registry decides at delete
# time: the entry goes only if it still has the epoch the lookup saw and the
# registry does not list the worker with that epoch.
_CLEAN_STALE_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if redis.call('HGET', KEYS[2], 'epoch') == ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[3])
return 1
"""

T = TypeVar("T")


def _chunks(items: Sequence[T], size: int = _CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class PrefixIndexPublisher:
    """One worker's writer of the prefix index; never raises on Redis failures.

    The engine loop must not stall or crash because Redis is down: a failed
    publish is counted and the publisher is marked out of sync, and the worker
    calls ``resync(all cached hashes)`` once Redis is back (the ``Heartbeat``
    ``on_reregistered`` hook is the natural place). Calls are serialised so
    that a resync and the publishes after it apply in call order.
    """

    def __init__(self, redis: Redis, prefix: str, worker: WorkerInfo, *, block_ttl_s: float = 3600.0) -> None:
        if not block_ttl_s > 0:
            raise ValueError(f"block_ttl_s must be > 0, got {block_ttl_s}")
        self._redis = redis
        self._keys = KeySpace(prefix)
        self._worker = worker
        self._epoch = str(worker.epoch)
        self._block_ttl_s = max(1, math.ceil(block_ttl_s))
        self._drop_entry = redis.register_script(_DROP_ENTRY_LUA)
        self._lock = asyncio.Lock()
        self._outage = OutageLog(logger, f"prefix index publisher of worker {worker.worker_id}")
        self._in_sync = True
        self._num_dropped_events = 0

    @property
    def in_sync(self) -> bool:
        """False once any write was lost, until a successful ``resync``."""
        return self._in_sync

    @property
    def num_dropped_events(self) -> int:
        """Block events (one per hash) not applied since the last successful ``resync``."""
        return self._num_dropped_events

    async def reset(self) -> bool:
        """At worker start: drop this worker id's entries from any earlier epoch."""
        async with self._lock:
            return await self._guard("reset", 0, self._drop_entries("other"))

    async def clear(self) -> bool:
        """At shutdown: drop this epoch's entries (a successor's, same id, stay)."""
        async with self._lock:
            return await self._guard("clear", 0, self._drop_entries("same"))

    async def publish(self, stored_hashes: Sequence[BlockHash] = (), removed_hashes: Sequence[BlockHash] = ()) -> bool:
        """Apply one net change (disjoint sets, see ``BlockEventBatch``) in one round trip; False if lost."""
        changes = BlockChanges(tuple(stored_hashes), tuple(removed_hashes))
        if not changes:
            return True
        async with self._lock:
            return await self._guard("publish", len(changes), self._write_changes(changes))

    async def resync(self, all_cached_hashes: Iterable[BlockHash]) -> bool:
        """Make this worker's entries exactly ``all_cached_hashes``; True (and in sync) on success."""
        cached = {block_hash.hex(): block_hash for block_hash in all_cached_hashes}
        async with self._lock:
            if not await self._guard("resync", 0, self._rewrite_all(cached)):
                return False
            logger.info("worker %s resynced %d cached blocks to the prefix index after %d dropped events",
                        self._worker.worker_id, len(cached), self._num_dropped_events)
            self._in_sync = True
            self._num_dropped_events = 0
            return True

    async def _guard(self, action: str, num_events: int, call: Awaitable[None]) -> bool:
        try:
            await call
        except UNAVAILABLE_ERRORS as error:
            self._outage.failed(error)
            logger.debug("prefix index %s lost: %s", action, error)
            self._in_sync = False
            self._num_dropped_events += num_events
            return False
        self._outage.recovered()
        return True

    async def _write_changes(self, changes: BlockChanges) -> None:
        worker_blocks = self._keys.worker_blocks(self._worker.worker_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            for block_hash in changes.stored:
                self._queue_store(pipe, block_hash)
            if changes.stored:
                pipe.sadd(worker_blocks, *(block_hash.hex() for block_hash in changes.stored))
            for block_hash in changes.removed:
                pipe.hdel(self._keys.block(block_hash), self._worker.worker_id)
            if changes.removed:
                pipe.srem(worker_blocks, *(block_hash.hex() for block_hash in changes.removed))
            pipe.expire(worker_blocks, self._block_ttl_s)
            await pipe.execute()

    async def _rewrite_all(self, cached: dict[str, BlockHash]) -> None:
        worker_blocks = self._keys.worker_blocks(self._worker.worker_id)
        published = {as_text(member) for member in await self._redis.smembers(worker_blocks)}
        # Any other entry of this worker id is wrong whatever its epoch: this process is the truth.
        stale = sorted(published - cached.keys())
        for chunk in _chunks(stale):
            async with self._redis.pipeline(transaction=False) as pipe:
                for hash_hex in chunk:
                    pipe.hdel(self._keys.block_from_hex(hash_hex), self._worker.worker_id)
                pipe.srem(worker_blocks, *chunk)
                await pipe.execute()
        for chunk in _chunks(list(cached.values())):
            async with self._redis.pipeline(transaction=False) as pipe:
                for block_hash in chunk:
                    self._queue_store(pipe, block_hash)
                pipe.sadd(worker_blocks, *(block_hash.hex() for block_hash in chunk))
                pipe.expire(worker_blocks, self._block_ttl_s)
                await pipe.execute()

    def _queue_store(self, pipe: Pipeline, block_hash: BlockHash) -> None:
        key = self._keys.block(block_hash)
        pipe.hset(key, self._worker.worker_id, self._epoch)
        pipe.expire(key, self._block_ttl_s)

    async def _drop_entries(self, mode: str) -> None:
        worker_blocks = self._keys.worker_blocks(self._worker.worker_id)
        members = sorted(as_text(member) for member in await self._redis.smembers(worker_blocks))
        for chunk in _chunks(members):
            async with self._redis.pipeline(transaction=False) as pipe:
                for hash_hex in chunk:
                    await self._drop_entry(
                        keys=[self._keys.block_from_hex(hash_hex), worker_blocks],
                        args=[self._worker.worker_id, self._epoch, mode, hash_hex],
                        client=pipe,
                    )
                await pipe.execute()


@dataclass(frozen=True)
class _StaleEntry:
    hash_hex: str
    worker_id: str
    epoch: str


class PrefixIndexLookup:
    """The gateway's reader: how many leading blocks of a request each live worker holds.

    One round trip per lookup (a pipeline of HGETALL, one per block hash); a
    second one only when stale entries were seen and get cleaned. When Redis is
    unreachable it returns ``{}`` within ``timeout_s`` so routing falls back to
    load alone.
    """

    def __init__(self, redis: Redis, prefix: str = DEFAULT_PREFIX, *, timeout_s: float = 0.5) -> None:
        self._redis = redis
        self._keys = KeySpace(prefix)
        self._timeout_s = timeout_s
        self._clean_stale = redis.register_script(_CLEAN_STALE_LUA)
        self._outage = OutageLog(logger, "prefix index lookup")

    async def longest_prefix(self, block_hashes: Sequence[BlockHash], live: Mapping[str, int]) -> dict[str, int]:
        """For each live worker (id -> current epoch): the number of leading ``block_hashes`` it holds.

        Counting stops at a worker's first missing block, since a block's KV is
        useless without the blocks before it. ``{}`` means the index is unavailable.
        """
        counts = dict.fromkeys(live, 0)
        if not block_hashes or not live:
            return counts
        try:
            entries = await asyncio.wait_for(self._fetch(block_hashes), self._timeout_s)
        except UNAVAILABLE_ERRORS as error:
            self._outage.failed(error)
            return {}
        self._outage.recovered()
        expected = {worker_id: str(epoch) for worker_id, epoch in live.items()}
        matching = set(expected)
        stale: list[_StaleEntry] = []
        for position, (block_hash, entry) in enumerate(zip(block_hashes, entries)):
            holders = {as_text(worker_id): as_text(epoch) for worker_id, epoch in entry.items()}
            stale.extend(
                _StaleEntry(block_hash.hex(), worker_id, epoch)
                for worker_id, epoch in holders.items()
                if expected.get(worker_id) != epoch
            )
            matching = {worker_id for worker_id in matching if holders.get(worker_id) == expected[worker_id]}
            for worker_id in matching:
                counts[worker_id] = position + 1
        if stale:
            await self._clean(stale)
        return counts

    async def _fetch(self, block_hashes: Sequence[BlockHash]) -> list[Mapping[bytes | str, bytes | str]]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for block_hash in block_hashes:
                pipe.hgetall(self._keys.block(block_hash))
            return await pipe.execute()

    async def _clean(self, stale: list[_StaleEntry]) -> None:
        try:
            await asyncio.wait_for(self._clean_entries(stale), self._timeout_s)
        except UNAVAILABLE_ERRORS as error:
            # Only hygiene: the next lookup that meets these entries tries again.
            logger.debug("cleaning %d stale prefix index entries failed: %s", len(stale), error)

    async def _clean_entries(self, stale: list[_StaleEntry]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for entry in stale:
                await self._clean_stale(
                    keys=[
                        self._keys.block_from_hex(entry.hash_hex),
                        self._keys.worker(entry.worker_id),
                        self._keys.worker_blocks(entry.worker_id),
                    ],
                    args=[entry.worker_id, entry.epoch, entry.hash_hex],
                    client=pipe,
                )
            cleaned = await pipe.execute()
        logger.debug("cleaned %d of %d stale prefix index entries", sum(cleaned), len(stale))
