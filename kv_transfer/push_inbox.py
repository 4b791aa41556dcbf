"""The decode side of a push: KV that prefill workers pushed here, held until the request's Decode takes it.

``PushInbox.receive`` is the body of the decode worker's PushKV handler: it
checks the header, allocates the whole tensor (grpc) or maps the sender's
shared-memory segment (shm, unlinked at once so that no name outlives the
push), writes or records each piece, and confirms once the stream half-closes
with every block of every layer there. A stream that breaks (the prefill worker
died, the request was cancelled) or does not cover every block drops what it
brought. ``take`` hands a complete push to the request's Decode and forgets it;
a push nobody takes within ``ttl_s`` is dropped. ``max_bytes`` bounds what the
inbox holds: past it a push is refused with RESOURCE_EXHAUSTED (the request is
then pulled).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory

import grpc
import torch

from kv_transfer.buffers import byte_view, empty_blocks
from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import KVHandoff, KVLayout, layout_from_proto
from kv_transfer.pusher import PUSH_TRANSPORTS
from kv_transfer.shm import _unlink
from protos.pdserve.v1.internal import worker_pb2

log = logging.getLogger(__name__)


class PushRejected(Exception):
    """A push this inbox will not hold; ``code`` is the gRPC status to end the stream with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class PushedKV:
    """One request's pushed KV: the whole (num_layers, 2, num_blocks, ...) tensor and which pieces arrived."""

    request_id: str
    layout: KVLayout
    num_blocks: int
    blocks: torch.Tensor
    received: torch.Tensor  # (num_layers, num_blocks) bool
    segment: SharedMemory | None = None
    complete: bool = False
    next_offset: int = 0  # grpc: where the piece being received continues (0: between pieces)
    started: float = field(default_factory=time.perf_counter)
    expiry: asyncio.TimerHandle | None = None

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    def release(self) -> SharedMemory | None:
        """Free the tensor and unmap the segment; the segment when a view of it is still alive (unmap it later)."""
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        segment, self.segment = self.segment, None
        self.blocks = self.received = torch.empty(0)
        if segment is not None and not _try_close(segment):
            return segment
        return None


class PushInbox:
    """Pushed KV by request id, bounded in bytes and in time."""

    def __init__(self, config: TransferConfig, max_bytes: int = 2 << 30, ttl_s: float = 30.0) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.config = config
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._entries: dict[str, PushedKV] = {}
        self.num_bytes = 0
        self.num_expired = 0
        # Segments whose KV was still viewed when released (being landed): unmapped at the next chance.
        self._lingering: list[SharedMemory] = []

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
            entry = self._open(first.header)
            async for message in messages:
                if not isinstance(message, worker_pb2.KVPushMessage) or not message.HasField("piece"):
                    raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "a KV push has one header, then pieces")
                if self._entries.get(entry.request_id) is not entry:
                    raise PushRejected(grpc.StatusCode.ABORTED,
                                       f"the KV push of {entry.request_id!r} was dropped here (its request ended)")
                _write(entry, message.piece)
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
        return worker_pb2.PushKVResponse(num_blocks=entry.num_blocks, total_bytes=entry.num_bytes)

    def take(self, handoff: KVHandoff) -> PushedKV | None:
        """The complete push of ``handoff``'s request, now the caller's to ``release``; None if there is none.

        A push whose layout or size disagrees with the handoff is dropped, and None returned.
        """
        entry = self._entries.get(handoff.request_id)
        if entry is None or not entry.complete:
            return None
        self._forget(entry)
        if entry.layout != handoff.layout or entry.num_blocks != handoff.num_blocks:
            log.warning("pushed KV of %s (%s, %d blocks) does not match its handoff (%s, %d blocks); dropped",
                        handoff.request_id, entry.layout, entry.num_blocks, handoff.layout, handoff.num_blocks)
            self.release(entry)
            return None
        return entry

    def discard(self, request_id: str) -> None:
        """Drop whatever was pushed for ``request_id`` (its Decode ended without taking it)."""
        self._drop(self._entries.get(request_id))

    def release(self, entry: PushedKV) -> None:
        """Free a push ``take`` handed out, once its KV has landed."""
        self._close_lingering()
        segment = entry.release()
        if segment is not None:
            self._lingering.append(segment)

    def close(self) -> None:
        for entry in list(self._entries.values()):
            self._drop(entry)
        self._close_lingering()

    # ---- internals ----------------------------------------------------------------

    def _open(self, header: worker_pb2.KVPushHeader) -> PushedKV:
        if not header.request_id:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "header.request_id must be set")
        if header.transport not in PUSH_TRANSPORTS:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                               f"header.transport must be one of {list(PUSH_TRANSPORTS)}, got {header.transport!r}")
        try:
            if not header.HasField("layout"):
                raise ValueError("header.layout is missing")
            layout = layout_from_proto(header.layout)
            if header.num_blocks < 1:
                raise ValueError(f"header.num_blocks must be at least 1, got {header.num_blocks}")
        except ValueError as error:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
        size = header.num_blocks * layout.bytes_per_block
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
        segment = None
        if header.transport == "shm":
            segment = _attach(header.shm_segment, size)
            blocks = torch.frombuffer(segment.buf, dtype=torch.uint8, count=size)
            blocks = blocks.view(layout.torch_dtype).view(layout.tensor_shape(header.num_blocks))
        else:
            blocks = empty_blocks(layout, header.num_blocks)
        received = torch.zeros(layout.num_layers, header.num_blocks, dtype=torch.bool)
        entry = PushedKV(header.request_id, layout, header.num_blocks, blocks, received, segment)
        self._entries[entry.request_id] = entry
        self.num_bytes += size
        return entry

    def _close_lingering(self) -> None:
        self._lingering = [segment for segment in self._lingering if not _try_close(segment)]

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
            self.release(entry)


def _try_close(segment: SharedMemory) -> bool:
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


def _write(entry: PushedKV, piece: worker_pb2.KVPushPiece) -> None:
    """Record ``piece`` (grpc: write its bytes) in ``entry``; PushRejected when it does not fit the header."""
    layout = entry.layout
    end_block = piece.first_block + piece.num_blocks
    expected_total = piece.num_blocks * layout.bytes_per_block // layout.num_layers
    if (
        piece.layer >= layout.num_layers
        or piece.num_blocks < 1
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
    if entry.segment is None:
        if not piece.data:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "a grpc KV push piece carries no data")
        # The piece is (1, 2, n, ...): its K half, then its V half, each contiguous here.
        half = piece.total_bytes // 2
        offset, data = piece.offset, memoryview(piece.data)
        while data.nbytes:
            kv = 0 if offset < half else 1
            target = byte_view(entry.blocks[piece.layer, kv, piece.first_block : end_block])
            start = offset - kv * half
            size = min(data.nbytes, half - start)
            target[start : start + size] = data[:size]
            offset, data = offset + size, data[size:]
        if offset < piece.total_bytes:
            entry.next_offset = offset
            return  # more of this piece follows
        entry.next_offset = 0
    entry.received[piece.layer, piece.first_block : end_block] = True
