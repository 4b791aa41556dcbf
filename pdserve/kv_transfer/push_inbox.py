"""The wire side of a push on a decode worker: a PushKV stream read into blocks the engine reserved for it.

``PushInbox.receive`` is the body of the decode worker's PushKV handler: it
checks the header, asks the engine's KV connector (through the ``PushLanding``
the service hands it) to reserve blocks for the pushed range, maps the
sender's shared-memory segment (shm, unlinked at once so that no name outlives
the push), hands each piece to the engine to write as it arrives, and confirms
once the stream half-closes with every block of every layer there. What the
push holds belongs to the connector from the reservation on: the request
adopts the blocks when its Decode comes (nothing is copied then), and the
connector frees them if the push breaks, is dropped or is never claimed. This
module only reads streams: a stream that breaks (the prefill worker died), ends
with an abandon (the request ended at its first token, or its prefill failed)
or does not cover every block has its push dropped. A
push whose request goes on ends with its ``KVPushStart`` (what the request's
Decode will carry): once it is complete, ``on_start`` gets it, so the service
can start decoding before the Decode comes. A push the connector does not take
(no free blocks, over its byte bound, or its request went elsewhere) ends with
RESOURCE_EXHAUSTED or ABORTED, and the request is pulled.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Protocol

import grpc
import torch

from pdserve.engine.kv.connector import PushedKV, PushRefused
from pdserve.engine.kv.handoff import torch_dtype_of
from pdserve.kv_transfer.buffers import byte_view
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.descriptor import KVLayout, layout_from_proto
from pdserve.kv_transfer.pusher import PUSH_TRANSPORTS
from pdserve.kv_transfer.shm import _unlink
from pdserve.protos.pdserve.v1.internal import worker_pb2

log = logging.getLogger(__name__)

# How a refusal of the engine's connector ends the stream.
_REFUSAL_CODES = {
    "dropped": grpc.StatusCode.ABORTED,
    "no_room": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "over_limit": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class PushRejected(Exception):
    """A push this inbox will not read on; ``code`` is the gRPC status to end the stream with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PushLanding(Protocol):
    """The engine's KV connector, seen from the event loop: where pushed KV lands.

    The service implements it over its engine; the inbox never touches the engine itself.
    ``write`` and ``drop`` return at once and take effect in call order, before
    anything the service asks of the engine afterwards (the request's Decode).
    """

    async def open(self, request_id: str, layout: KVLayout, first_block: int, num_blocks: int) -> PushedKV:
        """Blocks for blocks ``first_block``..``num_blocks`` of ``request_id``'s push in ``layout``.
        Raises ``PushRefused`` when the engine does not take it, ``ValueError`` naming the field when
        KV of ``layout`` cannot land here."""
        ...

    def write(self, push: PushedKV, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        """Layer ``layer`` of blocks ``first_block``..: (1, 2, n, block_size, num_kv_heads, row_size), which
        must stay unchanged (and mapped) until it is written."""
        ...

    def drop(self, push: PushedKV) -> None:
        ...

    def after_writes(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once every write asked for so far is done (or will never be): what unmaps a segment."""
        ...


@dataclass
class _Stream:
    """One PushKV stream being read: which (layer, block) pieces arrived, and the piece being assembled."""

    push: PushedKV
    received: torch.Tensor  # (num_layers, num_blocks) bool
    segment: SharedMemory | None = None
    shm_blocks: torch.Tensor | None = None  # shm: the sender's whole tensor, mapped
    piece: torch.Tensor | None = None  # grpc: the piece being received, (1, 2, n, ...)
    piece_at: tuple[int, int] = (0, 0)  # grpc: its (layer, first_block)
    next_offset: int = 0  # grpc: where the piece being received continues (0: between pieces)
    start: worker_pb2.KVPushStart | None = None  # the stream's last message, when it had one


class PushInbox:
    """Reads PushKV streams into the engine's reserved blocks; ``on_start`` hears of each complete push that
    announced its request's start (called on the event loop with the request id and the start)."""

    def __init__(
        self,
        config: TransferConfig,
        landing: PushLanding,
        on_start: Callable[[str, worker_pb2.KVPushStart], None] | None = None,
    ) -> None:
        self.config = config
        self.landing = landing
        self.on_start = on_start
        self.num_receiving = 0  # streams being read now

    async def receive(
        self, messages: AsyncIterator[worker_pb2.KVPushMessage], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushKVResponse:
        """Take one PushKV stream; the response once every block is here, else the stream's error status."""
        stream: _Stream | None = None
        self.num_receiving += 1
        try:
            first = await anext(messages, None)
            if not isinstance(first, worker_pb2.KVPushMessage) or not first.HasField("header"):
                raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "a KV push must start with its header")
            stream = await self._open(first.header)
            async for message in messages:
                if not isinstance(message, worker_pb2.KVPushMessage) or stream.start is not None or not (
                    message.HasField("piece") or message.HasField("start") or message.HasField("abandon")
                ):
                    raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                       "a KV push has one header, then pieces, then at most one start or abandon")
                if message.HasField("abandon"):
                    raise PushRejected(grpc.StatusCode.ABORTED,
                                       f"the KV push of {stream.push.request_id!r} was abandoned by its sender "
                                       "(its request ended)")
                if message.HasField("start"):
                    stream.start = message.start
                    continue
                _check_not_dropped(stream.push)
                _write(stream, message.piece, self.landing)
            _check_not_dropped(stream.push)
            missing = int((~stream.received).sum())
            if missing:
                raise PushRejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the KV push of {stream.push.request_id!r} ended with {missing} of "
                    f"{stream.received.numel()} (layer, block) pieces missing",
                )
        except PushRejected as error:
            self._end(stream, drop=True)
            await context.abort(error.code, str(error))
        except BaseException:
            # Cancelled or broken (the prefill worker died or gave up): nothing half-pushed stays.
            self._end(stream, drop=True)
            raise
        finally:
            self.num_receiving -= 1
        self._end(stream, drop=False)
        if stream.start is not None and self.on_start is not None:
            self.on_start(stream.push.request_id, stream.start)
        push = stream.push
        return worker_pb2.PushKVResponse(num_blocks=push.num_blocks, total_bytes=push.num_bytes)

    # ---- internals ----------------------------------------------------------------

    async def _open(self, header: worker_pb2.KVPushHeader) -> _Stream:
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
            if header.first_block >= header.num_blocks:
                raise ValueError(f"header.first_block {header.first_block} must be below num_blocks {header.num_blocks}")
        except ValueError as error:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
        # The sender's segment holds the whole tensor, the unpushed blocks' room left unwritten.
        segment_size = header.num_blocks * layout.bytes_per_block
        segment = _attach(header.shm_segment, segment_size) if header.transport == "shm" else None
        try:
            push = await self.landing.open(header.request_id, layout, header.first_block, header.num_blocks)
        except BaseException as error:
            if segment is not None:
                segment.close()
            if isinstance(error, PushRefused):
                raise PushRejected(_REFUSAL_CODES[error.reason], str(error)) from error
            if isinstance(error, ValueError):
                raise PushRejected(grpc.StatusCode.FAILED_PRECONDITION, f"header.layout: {error}") from error
            raise
        shm_blocks = None
        if segment is not None:
            shm_blocks = torch.frombuffer(segment.buf, dtype=torch.uint8, count=segment_size)
            shm_blocks = shm_blocks.view(torch_dtype_of(layout)).view(layout.tensor_shape(header.num_blocks))
        received = torch.zeros(layout.num_layers, header.num_blocks, dtype=torch.bool)
        received[:, : header.first_block] = True  # not pushed: cached here
        return _Stream(push, received, segment, shm_blocks)

    def _end(self, stream: _Stream | None, drop: bool) -> None:
        """The stream is over: its push dropped (``drop``) or left to the connector; its segment unmapped
        once no queued write reads it any more."""
        if stream is None:
            return
        if drop:
            self.landing.drop(stream.push)
        segment, stream.segment = stream.segment, None
        stream.shm_blocks = stream.piece = None
        if segment is not None:
            self.landing.after_writes(functools.partial(_try_close, segment))


def _check_not_dropped(push: PushedKV) -> None:
    if push.dropped:
        raise PushRejected(grpc.StatusCode.ABORTED,
                           f"the KV push of {push.request_id!r} was dropped here (its request ended)")


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


def _write(stream: _Stream, piece: worker_pb2.KVPushPiece, landing: PushLanding) -> None:
    """Land ``piece`` of ``stream`` (grpc: once its last bytes are here); PushRejected when it does not fit the header."""
    push = stream.push
    layout = push.layout
    end_block = piece.first_block + piece.num_blocks
    expected_total = piece.num_blocks * layout.bytes_per_block // layout.num_layers
    if (
        piece.layer >= layout.num_layers
        or piece.num_blocks < 1
        or piece.first_block < push.first_block
        or end_block > push.num_blocks
        or piece.total_bytes != expected_total
        or piece.offset + len(piece.data) > piece.total_bytes
    ):
        raise PushRejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"KV push piece (layer {piece.layer}, blocks {piece.first_block}+{piece.num_blocks}, "
            f"{len(piece.data)} bytes at {piece.offset} of {piece.total_bytes}) does not fit "
            f"{layout.num_layers} layers x {push.num_blocks} blocks",
        )
    if piece.offset != stream.next_offset:
        raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"KV push piece data at offset {piece.offset}, expected {stream.next_offset}")
    if stream.segment is not None and piece.data:
        raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "an shm KV push piece carries no data")
    if stream.shm_blocks is not None:
        blocks = stream.shm_blocks[piece.layer : piece.layer + 1, :, piece.first_block : end_block]
    else:
        if not piece.data:
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT, "a grpc KV push piece carries no data")
        if piece.offset == 0:
            shape = layout.tensor_shape(piece.num_blocks)
            stream.piece = torch.empty((1, *shape[1:]), dtype=torch_dtype_of(layout))
            stream.piece_at = (piece.layer, piece.first_block)
        elif stream.piece is None or stream.piece_at != (piece.layer, piece.first_block) or (
            stream.piece.shape[2] != piece.num_blocks
        ):
            raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                               "KV push piece data continues a different piece than the one being received")
        # The piece is (1, 2, n, ...) on the wire as here: its K half, then its V half.
        end = piece.offset + len(piece.data)
        byte_view(stream.piece)[piece.offset : end] = piece.data
        if end < piece.total_bytes:
            stream.next_offset = end
            return  # more of this piece follows
        stream.next_offset = 0
        blocks, stream.piece = stream.piece, None
    landing.write(push, piece.layer, piece.first_block, blocks)
    stream.received[piece.layer, piece.first_block : end_block] = True
