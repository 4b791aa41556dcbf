"""KV pushed to a decode engine before its request arrives: the blocks reserved for it and its state.

``PushTable`` is the scheduler side's record of pushes (engine thread only):
it reserves blocks for a push as it opens, learns from the worker side when
the last piece is written, hands a landed push's blocks to the request that
claims it, and frees the blocks of a push that breaks, is dropped, or is not
claimed before the handoff deadline. A push dropped before it opens (its
request went elsewhere) is refused when it does open, until the deadline.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.types.handoff import KVHandoff, KVLayout, KVReservation

log = logging.getLogger(__name__)


class PushState(enum.Enum):
    ARRIVING = "arriving"  # blocks reserved, its pieces being written layer by layer
    LANDED = "landed"  # every layer of every pushed block written: a request may adopt the blocks
    BROKEN = "broken"  # a piece could not be written: the blocks are no use, its request pulls


class PushRefused(Exception):
    """A push this engine does not take. ``reason``: "dropped" (its request ended or went elsewhere),
    "no_room" (no free blocks for it now) or "over_limit" (pushed KV held here would pass its bound)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(eq=False)
class PushedKV:
    """One request's pushed KV: the blocks reserved for it (``reservation``) and how far the writes got."""

    request_id: str  # the handoff's (the prefill side's) request id
    layout: KVLayout
    num_blocks: int  # of the handoff; the reservation holds blocks first_block..num_blocks
    reservation: KVReservation
    expires_at: float  # time.monotonic(): dropped then unless claimed (from the open, then from the landing)
    state: PushState = PushState.ARRIVING
    landed_at: float | None = None
    # Set on the engine thread when the push is dropped (its blocks freed): the stream still
    # delivering it (another thread) stops, and pieces still queued are not written.
    dropped: bool = field(default=False)

    @property
    def first_block(self) -> int:
        return self.reservation.first_block

    @property
    def num_bytes(self) -> int:
        return len(self.reservation.block_ids) * self.layout.bytes_per_block


class PushTable:
    """Pushes by request id, bounded by the pool and by the handoff deadline (``timeout_s``)."""

    def __init__(
        self, block_manager: BlockManager, layout: KVLayout, timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._block_manager = block_manager
        self._layout = layout
        self.timeout_s = timeout_s
        self._clock = clock
        self._pushes: dict[str, PushedKV] = {}
        # Requests whose push was dropped before it opened: refused until then (time.monotonic()).
        self._refused: dict[str, float] = {}
        self.num_bytes = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._pushes)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pushes

    def open(self, request_id: str, layout: KVLayout, first_block: int, num_blocks: int,
             max_bytes: int) -> PushedKV:
        """Reserve blocks ``first_block``..``num_blocks`` for a push of ``request_id``'s KV in ``layout``.

        A newer push of the same request replaces an older one (a retried prefill pushes again).
        ``PushRefused`` when it is not taken (see its reasons); ``ValueError`` naming the field when
        KV of ``layout`` cannot land here.
        """
        own = self._layout
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "kv_parts"):
            if getattr(layout, name) != getattr(own, name):
                raise ValueError(f"layout.{name} {getattr(layout, name)} != this worker's {getattr(own, name)}")
        if not 0 <= first_block < num_blocks:
            raise ValueError(f"first_block {first_block} must be below num_blocks {num_blocks}")
        if self._refused.get(request_id, float("-inf")) > self._clock():
            raise PushRefused("dropped", f"the KV push of {request_id!r} was dropped here (its request ended)")
        self.drop(request_id)
        size = (num_blocks - first_block) * layout.bytes_per_block
        if self.num_bytes + size > max_bytes:
            raise PushRefused("over_limit", f"pushed KV would hold {self.num_bytes + size} bytes here, over the "
                                            f"limit of {max_bytes}; pull it instead")
        if not self._block_manager.can_reserve(num_blocks - first_block):
            raise PushRefused("no_room", f"no {num_blocks - first_block} free KV blocks here for the push; "
                                         "pull it instead")
        reservation = KVReservation(first_block, tuple(self._block_manager.reserve(num_blocks - first_block)))
        entry = PushedKV(request_id, layout, num_blocks, reservation, self._clock() + self.timeout_s)
        self._pushes[request_id] = entry
        self.num_bytes += entry.num_bytes
        return entry

    def landed(self, entry: PushedKV) -> None:
        """The worker side wrote ``entry``'s last piece: the deadline counts from now."""
        if entry.state is PushState.ARRIVING:
            entry.state, entry.landed_at = PushState.LANDED, self._clock()
            entry.expires_at = entry.landed_at + self.timeout_s

    def broken(self, entry: PushedKV) -> None:
        """A piece of ``entry`` could not be written: no request may decode from its blocks."""
        entry.state = PushState.BROKEN

    def claim(self, handoff: KVHandoff) -> KVReservation | None:
        """The blocks of ``handoff``'s landed push, now the caller's (a request adopts them); None if there is
        none. A push that broke, has not landed, or disagrees with the handoff is dropped: the request pulls."""
        entry = self._pushes.get(handoff.request_id)
        if entry is None:
            log.warning("the KV of %s was pushed but is not here (dropped or expired); pulling it",
                        handoff.request_id)
            return None
        if entry.state is not PushState.LANDED or entry.layout != handoff.layout or (
            entry.num_blocks != handoff.num_blocks
        ):
            log.warning("pushed KV of %s (%s, %s, %d blocks) does not serve its handoff (%s, %d blocks); dropped",
                        handoff.request_id, entry.state.value, entry.layout, entry.num_blocks, handoff.layout,
                        handoff.num_blocks)
            self.drop(handoff.request_id)
            return None
        self._forget(entry)
        return entry.reservation

    def drop(self, request_id: str, entry: PushedKV | None = None, refuse_later: bool = False) -> None:
        """Free the push of ``request_id`` (only if it is ``entry``, when given). ``refuse_later``: its request
        will not use one, so a push of it that opens within the deadline is refused."""
        current = self._pushes.get(request_id)
        if current is not None and (entry is None or current is entry):
            self._forget(current)
            current.dropped = True  # its blocks go back: a stream still delivering it stops
            self._block_manager.free_reserved(current.reservation)
        if refuse_later:
            self._refused[request_id] = self._clock() + self.timeout_s

    def free(self, reservation: KVReservation) -> None:
        """Give back the blocks of a claimed push that no request took after all."""
        self._block_manager.free_reserved(reservation)

    def landed_since(self, since: float) -> int:
        """Landed pushes not claimed yet that landed at or after ``since`` (time.monotonic())."""
        return sum(1 for entry in self._pushes.values() if entry.landed_at is not None and entry.landed_at >= since)

    def expire(self) -> list[str]:
        """Drop every push past its deadline (its request never came); their request ids."""
        now = self._clock()
        expired = [entry for entry in self._pushes.values() if entry.expires_at <= now]
        for entry in expired:
            log.info("pushed KV of %s was not claimed in %g s; dropped", entry.request_id, self.timeout_s)
            self.num_expired += 1
            self.drop(entry.request_id, entry)
        for request_id in [r for r, until in self._refused.items() if until <= now]:
            del self._refused[request_id]
        return [entry.request_id for entry in expired]

    def drop_all(self) -> None:
        for request_id in list(self._pushes):
            self.drop(request_id)

    def _forget(self, entry: PushedKV) -> None:
        del self._pushes[entry.request_id]
        self.num_bytes -= entry.num_bytes
