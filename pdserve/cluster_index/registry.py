"""Worker registry: which prefill and decode workers are alive, where, and how loaded.

Each worker keeps ``{prefix}:worker:{worker_id}`` alive by heartbeats; the key's
TTL is the liveness test, enforced by Redis's clock so that hosts' clocks never
need to agree. The epoch changes with every process start, so the gateway can
tell a restarted worker (whose KV cache is empty) from the one it knew.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from redis.asyncio import Redis

from pdserve.cluster_index.connection import as_text, translate_errors
from pdserve.cluster_index.keys import DEFAULT_PREFIX, KeySpace

logger = logging.getLogger(__name__)

WorkerRole = Literal["prefill", "decode"]
WORKER_ROLES: tuple[str, ...] = get_args(WorkerRole)

# A worker's load figures, and (when it serves LoRA) "lora_adapters": the adapters it holds.
LoadSnapshot = Mapping[str, "float | list[str]"]

# Delete the entry only if it still belongs to the caller's epoch: a restarted
# process with the same worker id may already have registered.
_DEREGISTER_LUA = """
if redis.call('HGET', KEYS[1], 'epoch') == ARGV[2] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

# Prune an id from the set only if its entry is really gone, so a worker that
# registers between our read and this call is not hidden from the next reader.
_PRUNE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.call('SREM', KEYS[2], ARGV[1])
end
return 0
"""


@dataclass(frozen=True)
class WorkerInfo:
    """Identity of one worker process as the gateway sees it."""

    worker_id: str
    role: WorkerRole
    address: str  # "host:port" of the worker's internal gRPC server
    epoch: int  # new value on every process start (e.g. time.time_ns())
    model_id: str
    block_size: int

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {self.role!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def to_fields(self) -> dict[str, str]:
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "address": self.address,
            "epoch": str(self.epoch),
            "model_id": self.model_id,
            "block_size": str(self.block_size),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> WorkerInfo:
        role = fields["role"]
        if role not in WORKER_ROLES:
            raise ValueError(f"unknown role {role!r}")
        return cls(
            worker_id=fields["worker_id"],
            role=role,  # type: ignore[arg-type]  # checked just above
            address=fields["address"],
            epoch=int(fields["epoch"]),
            model_id=fields["model_id"],
            block_size=int(fields["block_size"]),
        )


@dataclass(frozen=True)
class WorkerStatus:
    """A live worker and the load it reported in its last heartbeat (empty before the first)."""

    info: WorkerInfo
    load: LoadSnapshot = field(default_factory=dict)

    @property
    def lora_adapters(self) -> list[str]:
        """The LoRA adapters the worker held at its last heartbeat."""
        adapters = self.load.get("lora_adapters", [])
        return list(adapters) if isinstance(adapters, list) else []


class WorkerRegistry:
    """Registers workers under a TTL and lists the live ones.

    Every method raises ``IndexUnavailable`` when Redis cannot be reached; the
    ``Heartbeat`` helper is the caller that absorbs those failures for workers.
    """

    def __init__(self, redis: Redis, prefix: str = DEFAULT_PREFIX, ttl_s: float = 10.0) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._redis = redis
        self._keys = KeySpace(prefix)
        self._ttl_ms = max(1, math.ceil(ttl_s * 1000))
        self.ttl_s = ttl_s
        self._deregister = redis.register_script(_DEREGISTER_LUA)
        self._prune = redis.register_script(_PRUNE_LUA)

    async def register(self, info: WorkerInfo) -> None:
        await self._write(info, load=None)

    async def heartbeat(self, info: WorkerInfo, load: LoadSnapshot | None = None) -> bool:
        """Refresh the entry's TTL and load snapshot; False when the entry had vanished first.

        The whole entry is rewritten each time, so a heartbeat also re-registers a
        worker whose entry expired or was lost with a Redis restart; the False
        return tells the worker its prefix-index entries may be gone too.
        """
        return await self._write(info, load)

    async def deregister(self, info: WorkerInfo) -> bool:
        """Remove the entry if it is still this epoch's; True when it was removed."""
        with translate_errors(f"deregister {info.worker_id}"):
            removed = await self._deregister(
                keys=[self._keys.worker(info.worker_id), self._keys.workers],
                args=[info.worker_id, str(info.epoch)],
            )
        return bool(removed)

    async def live_workers(self, role: WorkerRole | None = None) -> list[WorkerInfo]:
        return [status.info for status in await self.live_statuses(role)]

    async def live_statuses(self, role: WorkerRole | None = None) -> list[WorkerStatus]:
        """Workers whose entry has not expired (of ``role`` if given), sorted by worker id."""
        with translate_errors("list live workers"):
            worker_ids = sorted(as_text(member) for member in await self._redis.smembers(self._keys.workers))
            if not worker_ids:
                return []
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker_id in worker_ids:
                    pipe.hgetall(self._keys.worker(worker_id))
                entries = await pipe.execute()
            expired = [worker_id for worker_id, entry in zip(worker_ids, entries) if not entry]
            if expired:
                await self._prune_ids(expired)
        statuses = []
        for worker_id, entry in zip(worker_ids, entries):
            if not entry:
                continue
            status = _parse_status(worker_id, entry)
            if status is not None and (role is None or status.info.role == role):
                statuses.append(status)
        return statuses

    async def _write(self, info: WorkerInfo, load: LoadSnapshot | None) -> bool:
        key = self._keys.worker(info.worker_id)
        fields = info.to_fields()
        if load is not None:
            fields["load"] = json.dumps(dict(load), sort_keys=True)
        with translate_errors(f"register {info.worker_id}"):
            # MULTI so a reader never sees the hash without its TTL or outside the set.
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.exists(key)
                pipe.hset(key, mapping=fields)
                pipe.pexpire(key, self._ttl_ms)
                pipe.sadd(self._keys.workers, info.worker_id)
                existed, *_ = await pipe.execute()
        return bool(existed)

    async def _prune_ids(self, worker_ids: list[str]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                await self._prune(keys=[self._keys.worker(worker_id), self._keys.workers], args=[worker_id], client=pipe)
            await pipe.execute()


def _parse_status(worker_id: str, entry: Mapping[bytes | str, bytes | str]) -> WorkerStatus | None:
    fields = {as_text(name): as_text(value) for name, value in entry.items()}
    try:
        info = WorkerInfo.from_fields(fields)
        load = json.loads(fields["load"]) if "load" in fields else {}
    except (KeyError, ValueError) as error:
        # Another version of pdserve or a hand edit; skipping it beats failing every route.
        logger.warning("ignoring malformed registry entry for worker %r: %s", worker_id, error)
        return None
    return WorkerStatus(info=info, load=load)
