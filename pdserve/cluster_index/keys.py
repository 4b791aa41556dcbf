"""The Redis key layout of one pdserve cluster, all under ``{prefix}:``.

``{prefix}:workers``              set of worker ids ever registered (stale ids pruned lazily)
``{prefix}:worker:{worker_id}``   hash: WorkerInfo fields + ``load`` (JSON); TTL = registry ttl
``{prefix}:blk:{hash_hex}``       hash: worker_id -> epoch of each worker caching that block; TTL refreshed on publish
``{prefix}:wblk:{worker_id}``     set of hash_hex a worker published, so its entries can be dropped without SCAN
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "pdserve"

# Glob metacharacters would make ``SCAN MATCH {prefix}:*`` (cleanup, debugging) match other clusters' keys.
_FORBIDDEN_IN_PREFIX = frozenset("*?[]\\ ")


@dataclass(frozen=True)
class KeySpace:
    """Builds every key of one cluster's namespace; the only place key names are spelled."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or self.prefix.endswith(":") or _FORBIDDEN_IN_PREFIX & set(self.prefix):
            raise ValueError(f"invalid key prefix {self.prefix!r}: non-empty, no trailing ':', no glob characters")

    @property
    def pattern(self) -> str:
        """``SCAN MATCH`` pattern for every key of this namespace."""
        return f"{self.prefix}:*"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def block(self, block_hash: bytes) -> str:
        return f"{self.prefix}:blk:{block_hash.hex()}"

    def block_from_hex(self, hash_hex: str) -> str:
        return f"{self.prefix}:blk:{hash_hex}"

    def worker_blocks(self, worker_id: str) -> str:
        return f"{self.prefix}:wblk:{worker_id}"
