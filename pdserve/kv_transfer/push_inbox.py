"""The decode side of a push: KV that prefill workers pushed here, written into blocks reserved for it.

``PushInbox.receive`` is the body of the decode worker's PushKV handler: it
checks the header, reserves the decode engine's blocks for the pushed range
through the ``PushLanding`` the service hands it, maps the sender's
shared-memory segment (shm, unlinked at once so that no name outlives the
push), writes each piece into the reserved blocks as it arrives, and confirms
once the stream half-closes with every block of every layer there. So when the
request's Decode comes, its KV is already where the engine reads it: the
request adopts the blocks, nothing is copied then. A stream that breaks (the
prefill worker died, the request was cancelled) or does not cover every block
frees what it reserved. A push whose request goes on ends with its
``KVPushStart`` (what the request's Decode will carry): once it is complete,
``on_start`` gets it, so the service can start decoding before the Decode
comes. ``take`` hands a complete push (its reservation) to the request (the
early start, or its Decode) and forgets it; a push nobody takes within ``ttl_s``
is dropped. ``max_bytes`` bounds what the inbox holds: past it, or when the
engine has no free blocks for it, a push is refused with RESOURCE_EXHAUSTED
(the request is then pulled).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from typing import Protocol

import grpc
import torch

from pdserve.engine.kv_handoff import KVReservation
from pdserve.kv_transfer.buffers import byte_view
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.descriptor import KVHandoff, KVLayout, layout_from_proto
from pdserve.kv_transfer.pusher import PUSH_TRANSPORTS
from pdserve.kv_transfer.shm import _unlink
from pdserve.protos.pdserve.v1.internal import worker_pb2

log = logging.getLogger(__name__)


class PushRejected(Exception):
    """A push this inbox will not hold; ``code`` is the gRPC status to end the stream with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PushLanding(Protocol):
    """Where pushed KV lands: blocks of the decode engine, reserved before the request arrives.

    The service implements it over its engine; the inbox never touches the engine itself.
    ``write`` and ``free`` return at once and take effect in call order, before
    anything the service asks of the engine afterwards (the request's Decode).
    """

    async def reserve(self, layout: KVLayout, first_block: int, end_block: int) -> KVReservation | None:
        """Blocks for blocks ``first_block``..``end_block`` of a push in ``layout``; None when there is no room now.
        Raises ``ValueError`` naming the field when KV of ``layout`` cannot land here."""
        ...

    def write(self, reservation: KVReservation, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        """Layer ``layer`` of blocks ``first_block``..: (1, 2, n, block_size, num_kv_heads, row_size), which
        must stay unchanged (and mapped) until it is written."""
        ...

    def free(self, reservation: KVReservation) -> None:
        ...

    def after_writes(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once every write asked for so far is done (or will never be): what unmaps a segment."""
        ...


@dataclass
class PushedKV:
    """One request's pushed KV: the blocks reserved for it and which (layer, block) pieces arrived."""

    request_id: str
    layout: KVLayout
    num_blocks: int
    first_block: int  # the blocks before it were not pushed
    reservation: KVReservation | None  # None once freed or handed to the request
    received: torch.Tensor  # (num_layers, num_blocks) bool
    segment: SharedMemory | None = None
    shm_blocks: torch.Tensor | None = None  # shm: the sender's whole tensor, mapped
    piece: torch.Tensor | None = None  # grpc: the piece being received, (1, 2, n, ...)
    piece_at: tuple[int, int] = (0, 0)  # grpc: its (layer, first_block)
    complete: bool = False
    start: worker_pb2.KVPushStart | None = None  # the stream's last message, when it had one
    next_offset: int = 0  # grpc: where the piece being received continues (0: between pieces)
    started: float = field(default_factory=time.perf_counter)
    expiry: asyncio.TimerHandle | None = None

    @property
    def num_bytes(self) -> int:
        return (self.num_blocks - self.first_block) * self.layout.bytes_per_block

    def release(self) -> SharedMemory | None:
        """Forget the pieces; the segment, for the caller to unmap once no write reads it any more."""
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        segment, self.segment = self.segment, None
        self.shm_blocks = self.piece = None
        self.received = torch.empty(0)
        return segment


class PushInbox:
    """Pushed KV by request id, bounded in bytes and in time."""

    def __init__(
        self,
        config: TransferConfig,
        landing: PushLanding,
        max_bytes: int = 2 << 30,
        ttl_s: float = 30.0,
        on_start: Callable[[PushedKV], None] | None = None,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.config = config
        self.landing = landing
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.on_start = on_start  # a complete push that carries its start message; called on the event loop
        self._entries: dict[str, PushedKV] = {}
        # Requests dropped before their push arrived (the gateway's DropPush raced it): refused for ttl_s.
        self._dropped: set[str] = set()
        self.num_bytes = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def receive(
        self, messages: AsyncIterator[worker_pb2.KVPushMessage], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushKVResponse:
        """Take one PushKV stream; the response once every block is here, else the stream's error status."""
        entry: PushedKV | None = None
        try:
            first = await anext(messages, None)
            if not isinstance(first, worker_pb2.KVPushMessage) or not first.HasField("header"):
                raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "a KV push must start with its header")
            entry = await self._open(first.header)
            async for message in messages:
                if not isinstance(message, worker_pb2.KVPushMessage) or entry.start is not None or not (
                    message.HasField("piece") or message.HasField("start")
                ):
                    raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                       "a KV push has one header, then pieces, then at most one start")
                if message.HasField("start"):
                    entry.start = message.start
                    continue
                if self._entries.get(entry.request_id) is not entry:
                    raise PushRejected(grpc.StatusCode.ABORTED,
                                       f"the KV push of {entry.request_id!r} was dropped here (its request ended)")
                _write(entry, message.piece, self.landing)
            if self._entries.get(entry.request_id) is not entry:
                raise PushRejected(grpc.StatusCode.ABORTED,
                                   f"the KV push of {entry.request_id!r} was dropped here (its request ended)")
            missing = int((~entry.received).sum())
            if missing:
                raise PushRejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the KV push of {entry.request_id!r} ended with {missing} of "
                    f"{entry.received.numel()} (layer, block) pieces missing",
                )
        except PushRejected as error:
            self._drop(entry)
            await context.abort(error.code, str(error))
        except BaseException:
            # Cancelled or broken (the prefill worker died or gave up): nothing half-pushed stays.
            self._drop(entry)
            raise
        entry.complete = True
        entry.expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, entry)
        if entry.start is not None and self.on_start is not None:
            self.on_start(entry)
        return worker_pb2.PushKVResponse(num_blocks=entry.num_blocks, total_bytes=entry.num_bytes)

    def take(self, handoff: KVHandoff) -> PushedKV | None:
        """The complete push of ``handoff``'s request, now the caller's to ``release``; None if there is none.

        Its ``reservation`` is the caller's too: hand it to the engine with the request, or ``landing.free`` it.
        A push whose layout or size disagrees with the handoff is dropped, and None returned.
        """
        entry = self._entries.get(handoff.request_id)
        if entry is None or not entry.complete:
            return None
        self._forget(entry)
        if entry.layout != handoff.layout or entry.num_blocks != handoff.num_blocks:
            log.warning("pushed KV of %s (%s, %d blocks) does not match its handoff (%s, %d blocks); dropped",
                        handoff.request_id, entry.layout, entry.num_blocks, handoff.layout, handoff.num_blocks)
            self._drop(entry)
            return None
        return entry

    def discard(self, request_id: str) -> None:
        """Drop whatever was pushed for ``request_id`` (its Decode ended without taking it).

        A push of it that opens later (its stream was slower than the gateway's word) is refused
        for ``ttl_s``, so it cannot hold blocks nobody will claim.
        """
        self._drop(self._entries.get(request_id))
        if request_id not in self._dropped:
            self._dropped.add(request_id)
            asyncio.get_running_loop().call_later(self.ttl_s, self._dropped.discard, request_id)

    def release(self, entry: PushedKV) -> None:
        """Free a push ``take`` handed out."""
        segment = entry.release()
        if segment is not None:
            # A write of a piece may still be queued: it reads the segment, which must stay mapped until then.
            self.landing.after_writes(functools.partial(_try_close, segment))

    def close(self) -> None:
        for entry in list(self._entries.values()):
            self._drop(entry)

    # ---- internals ----------------------------------------------------------------

    async def _open(self, header: worker_pb2.KVPushHeader) -> PushedKV:
        if not header.request_id:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "header.request_id must be set")
        if header.request_id in self._dropped:
            raise PushRejected(grpc.StatusCode.ABORTED,
                               f"the KV push of {header.request_id!r} was dropped here (its request ended)")
        if header.transport not in PUSH_TRANSPORTS:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                               f"header.transport must be one of {list(PUSH_TRANSPORTS)}, got {header.transport!r}")
        try:
            if not header.HasField("layout"):
                raise ValueError("header.layout is missing")
            layout = layout_from_proto(header.layout)
            if header.num_blocks < 1:
                raise ValueError(f"header.num_blocks must be at least 1, got {header.num_blocks}")
            if header.first_block >= header.num_blocks:
                raise ValueError(f"header.first_block {header.first_block} must be below num_blocks {header.num_blocks}")
        except ValueError as error:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
        size = (header.num_blocks - header.first_block) * layout.bytes_per_block
        previous = self._entries.get(header.request_id)
        if previous is not None:
            # A retried prefill pushes again: the newer push replaces the older.
            self._drop(previous)
        if self.num_bytes + size > self.max_bytes:
            raise PushRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"pushed KV would hold {self.num_bytes + size} bytes here, over the limit of {self.max_bytes}; "
                "pull it instead",
            )
        # The sender's segment holds the whole tensor, the unpushed blocks' room left unwritten.
        segment_size = header.num_blocks * layout.bytes_per_block
        segment = _attach(header.shm_segment, segment_size) if header.transport == "shm" else None
        try:
            reservation = await self.landing.reserve(layout, header.first_block, header.num_blocks)
            if reservation is None:
                raise PushRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"no {header.num_blocks - header.first_block} free KV blocks here for the push; "
                                   "pull it instead")
        except BaseException as error:
            if segment is not None:
                segment.close()
            if isinstance(error, ValueError):
                raise PushRejected(grpc.StatusCode.FAILED_PRECONDITION, f"header.layout: {error}") from error
            raise
        if header.request_id in self._dropped:
            # The gateway's DropPush came while the blocks were being reserved: it found no entry to drop,
            # and a push registered now would hold the blocks until it expired.
            self.landing.free(reservation)
            if segment is not None:
                segment.close()
            raise PushRejected(grpc.StatusCode.ABORTED,
                               f"the KV push of {header.request_id!r} was dropped here (its request ended)")
        shm_blocks = None
        if segment is not None:
            shm_blocks = torch.frombuffer(segment.buf, dtype=torch.uint8, count=segment_size)
            shm_blocks = shm_blocks.view(layout.torch_dtype).view(layout.tensor_shape(header.num_blocks))
        received = torch.zeros(layout.num_layers, header.num_blocks, dtype=torch.bool)
        received[:, : header.first_block] = True  # not pushed: cached here
        entry = PushedKV(header.request_id, layout, header.num_blocks, header.first_block, reservation, received,
                         segment, shm_blocks)
        previous = self._entries.get(header.request_id)
        if previous is not None:
            # Another push of the same request was opened while this one reserved: the newer replaces the older.
            self._drop(previous)
        self._entries[entry.request_id] = entry
        self.num_bytes += size
        return entry

    def _expire(self, entry: PushedKV) -> None:
        if self._entries.get(entry.request_id) is entry:
            log.info("pushed KV of %s was not claimed in %g s; dropped", entry.request_id, self.ttl_s)
            self.num_expired += 1
            self._drop(entry)

    def _forget(self, entry: PushedKV) -> None:
        if self._entries.get(entry.request_id) is entry:
            del self._entries[entry.request_id]
            self.num_bytes -= entry.num_bytes

    def _drop(self, entry: PushedKV | None) -> None:
        if entry is not None:
            self._forget(entry)
            reservation, entry.reservation = entry.reservation, None
            if reservation is not None:
                self.landing.free(reservation)
            self.release(entry)


def _try_close(segment: SharedMemory) -> bool:
    """Unmap ``segment``; False when a view of it is still exported (it is unmapped when collected)."""
    try:
        segment.close()
    except BufferError:
        return False
    return True


def _attach(name: str, size: int) -> SharedMemory:
    if not name or "/" in name:
        raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, f"header.shm_segment is not a segment name: {name!r}")
    try:
        segment = SharedMemory(name=name)
    except FileNotFoundError:
        raise PushRejected(grpc.StatusCode.FAILED_PRECONDITION, f"shm segment {name!r} does not exist") from None
    # Mapped: the name is no longer needed, and unlinking now means none can leak.
    _unlink(segment)
    if segment.size < size:
        segment.close()
        raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"shm segment {name!r} holds {segment.size} bytes, the header says {size}")
    return segment


def _write(entry: PushedKV, piece: worker_pb2.KVPushPiece, landing: PushLanding) -> None:
    """Land ``piece`` of ``entry`` (grpc: once its last bytes are here); PushRejected when it does not fit the header."""
    layout = entry.layout
    end_block = piece.first_block + piece.num_blocks
    expected_total = piece.num_blocks * layout.bytes_per_block // layout.num_layers
    if (
        piece.layer >= layout.num_layers
        or piece.num_blocks < 1
        or piece.first_block < entry.first_block
        or end_block > entry.num_blocks
        or piece.total_bytes != expected_total
        or piece.offset + len(piece.data) > piece.total_bytes
    ):
        raise PushRejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"KV push piece (layer {piece.layer}, blocks {piece.first_block}+{piece.num_blocks}, "
            f"{len(piece.data)} bytes at {piece.offset} of {piece.total_bytes}) does not fit "
            f"{layout.num_layers} layers x {entry.num_blocks} blocks",
        )
    if piece.offset != entry.next_offset:
        raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"KV push piece data at offset {piece.offset}, expected {entry.next_offset}")
    if entry.segment is not None and piece.data:
        raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "an shm KV push piece carries no data")
    assert entry.reservation is not None, "a push being received holds its reservation"
    if entry.shm_blocks is not None:
        blocks = entry.shm_blocks[piece.layer : piece.layer + 1, :, piece.first_block : end_block]
    else:
        if not piece.data:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "a grpc KV push piece carries no data")
        if piece.offset == 0:
            shape = layout.tensor_shape(piece.num_blocks)
            entry.piece = torch.empty((1, *shape[1:]), dtype=layout.torch_dtype)
            entry.piece_at = (piece.layer, piece.first_block)
        elif entry.piece is None or entry.piece_at != (piece.layer, piece.first_block) or (
            entry.piece.shape[2] != piece.num_blocks
        ):
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                               "KV push piece data continues a different piece than the one being received")
        # The piece is (1, 2, n, ...) on the wire as here: its K half, then its V half.
        end = piece.offset + len(piece.data)
        byte_view(entry.piece)[piece.offset : end] = piece.data
        if end < piece.total_bytes:
            entry.next_offset = end
            return  # more of this piece follows
        entry.next_offset = 0
        blocks, entry.piece = entry.piece, None
    landing.write(entry.reservation, piece.layer, piece.first_block, blocks)
    entry.received[piece.layer, piece.first_block : end_block] = True
