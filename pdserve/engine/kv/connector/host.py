"""What the decode connector works with: its engine's parts, and the few calls it makes back into the engine.

The connector never holds the engine object. The engine hands it the pool
(``KVCache``), the block manager and the layout it shares, the scheduler's
queue of requests waiting for remote KV (``RemoteKVQueue``), the draft model's
pool when there is one, how a tensor-parallel engine lands a handoff on every
rank, and three calls (``ConnectorHost``): build a handed-off request's
sequence, admit it, and report its state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVCache
from pdserve.engine.kv.handoff import KVFetch
from pdserve.engine.sequence import Sequence
from pdserve.engine.types.handoff import KVHandoff, KVLayout, KVSlot
from pdserve.engine.types.outputs import RequestOutput
from pdserve.engine.types.sampling_params import SamplingParams


class ConnectorHost(Protocol):
    """The engine's side of a handoff: what only the engine can do with a request (``LLMEngine`` is one)."""

    def remote_sequence(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, handoff: KVHandoff
    ) -> Sequence:
        """The sequence of a request prefilled elsewhere, its prompt computed and its first token appended;
        ``ValueError`` naming the field when ``handoff`` or the request cannot be served here."""
        ...

    def admit_remote(self, seq: Sequence) -> None:
        """Track ``seq`` as one of the engine's requests and queue it for blocks (WAITING_FOR_REMOTE_KVS)."""
        ...

    def output_of(self, seq: Sequence) -> RequestOutput:
        """The state of ``seq`` now, as a step would report it."""
        ...


class RemoteKVQueue(Protocol):
    """The scheduler's requests whose prompt KV comes from another engine (``Scheduler`` is one)."""

    @property
    def receiving(self) -> Mapping[str, Sequence]:
        """The requests that hold their blocks and wait for their KV, by id."""
        ...

    def drain_kv_slots(self) -> list[KVSlot]:
        """The requests that got their blocks since the last call, each with where its KV goes."""
        ...

    def kv_received(self, seq: Sequence) -> None:
        """The KV of a receiving sequence landed: it runs from the next step on."""
        ...

    def kv_lost(self, seq: Sequence) -> None:
        """The KV of a receiving sequence will never land: it is recomputed here."""
        ...


class DraftKV(Protocol):
    """A draft model's KV pool beside the target's (``DraftModelProposer`` is one)."""

    @property
    def kv_cache(self) -> KVCache | None:
        ...

    def accepts(self, layout: KVLayout, draft_model_id: str) -> bool:
        """Whether a handoff's draft section (its layout, the draft that built it) can be imported here."""
        ...


# A tensor-parallel engine's landing of a handoff on every rank: (rank 0's pool, the fetch, the first block,
# the blocks to fill) -> whether every rank got its heads.
RankImport = Callable[[KVCache, KVFetch, int, Seq[int]], bool]


@dataclass(frozen=True)
class ConnectorParts:
    """Everything a decode connector is built from."""

    host: ConnectorHost
    queue: RemoteKVQueue
    block_manager: BlockManager
    kv_cache: KVCache
    kv_layout: KVLayout
    # What nobody claims is dropped after this many seconds (the engine's one handoff deadline).
    timeout_s: float
    draft: DraftKV | None = None
    # Set on a tensor-parallel engine: each rank fetches its own heads, so no push lands here.
    import_on_ranks: RankImport | None = None
