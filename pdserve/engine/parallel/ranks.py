"""The ranks as the runner and the KV shards see them: what they need of rank 0's handle and of a follower.

``workers.TensorParallelWorkers`` (rank 0) and ``workers._Follower`` (every
other rank) are the implementations; the modules below ``workers`` name only
these protocols, so the rank processes' own module stays on top.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from pdserve.engine.kv.cache import KVCache
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.step_codec import StepInputs


class LeaderRanks(Protocol):
    """Rank 0's handle on ranks 1..N-1: one command at a time under ``lock``, then the collectives it implies."""

    @property
    def world_size(self) -> int: ...

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    @property
    def group(self) -> TensorParallelGroup | None: ...

    @property
    def comm_device(self) -> torch.device: ...

    def command(self, header: list[int]) -> None:
        """Start a command (``step_codec.Command``) on every other rank."""
        ...

    def broadcast_step(self, inputs: StepInputs) -> None:
        """Send the other ranks one step's inputs (under ``lock``)."""
        ...

    def gather_logits(self, model: torch.nn.Module, hidden_rows: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of ``hidden_rows``, each rank computing its part of the vocabulary."""
        ...


class FollowerRank(Protocol):
    """One rank other than 0 while it runs a command: its group, its share of the pool and its KV heads."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def group(self) -> TensorParallelGroup | None: ...

    @property
    def kv_cache(self) -> KVCache: ...

    @property
    def kv_heads(self) -> range:
        """The global KV heads this rank holds."""
        ...

    @property
    def total_kv_heads(self) -> int: ...

    @property
    def comm_device(self) -> torch.device: ...
