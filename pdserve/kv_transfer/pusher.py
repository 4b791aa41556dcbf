"""The prefill side of a push: a request's KV sent to its decode worker while the prefill runs.

``KVPusher`` is the prefill engine's ``KVPushSink`` (``pdserve.engine.kv.push``). The
prefill service calls ``start`` before the request enters the engine; from then
on the engine thread hands it each layer's blocks as they are written, and a
task on the event loop streams them to the decode worker's PushKV. ``finish``
sends the request's ``KVPushStart`` (what its Decode will carry, so that the
decode worker starts decoding the moment the KV is complete), ends the stream
and waits (bounded) for the decode worker's confirmation that it holds every
block; ``cancel`` stops a push at once, ending its stream with an abandon so that
the decode worker drops what arrived. A push that fails in any way only costs the
pushed bytes: the prefill worker holds the KV under its lease whatever happens,
and the decode worker pulls it instead.

Transports: grpc (the pieces travel in the stream, at most ``chunk_bytes`` a
message) and shm (the engine thread copies each piece into one shared-memory
segment of the whole tensor, and the stream only says which pieces are there).
torch_dist and cuda_ipc are not pushed: their rendezvous is driven by the
receiver, so those handoffs are pulled.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory

import grpc
import torch

from pdserve.engine.kv.handoff import torch_dtype_of
from pdserve.kv_transfer.buffers import byte_view, host_contiguous
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.descriptor import KVLayout, layout_to_proto
from pdserve.kv_transfer.shm import _reserve, _unlink
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# Transports a prefill worker pushes over; the others are always pulled.
PUSH_TRANSPORTS: tuple[str, ...] = ("grpc", "shm")

_END = object()  # every piece was handed over (the prefill finished)
_NO_START = object()  # finish() without a start message: the stream ends after the pieces
_ABANDON = object()  # cancel(): the stream ends with an abandon, and the decode worker drops what it got


@dataclass
class _Push:
    request_id: str
    address: str
    transport: str
    layout: KVLayout
    num_blocks: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[object] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[bool] | None = None
    # shm: the segment and a tensor view of it, written by the engine thread under ``lock``.
    segment: SharedMemory | None = None
    tensor: torch.Tensor | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False  # no more writes: the segment is (being) unmapped
    opened: bool = False  # the stream is opened with the first piece, not while the request queues
    queued_bytes: int = 0
    stopped: bool = False  # under KVPusher._lock, with queued_bytes: no more bytes are counted
    first_block: int = 0  # the blocks before it are not pushed (the decode worker caches them)
    abandoned: bool = False  # cancel() ended it: the decode worker's refusal is expected


class KVPusher:
    """Pushes held requests' KV to decode workers; one PushKV stream per request.

    ``stub_for(address)`` gives the decode worker's stub (the service owns the
    channels). ``max_queued_bytes`` bounds the KV waiting to be sent, over all
    requests: past it a push is given up (and the request pulled), so a slow
    decode worker cannot grow the prefill worker's memory without bound.
    """

    def __init__(
        self,
        config: TransferConfig,
        stub_for: Callable[[str], worker_pb2_grpc.DecodeWorkerStub],
        max_queued_bytes: int = 1 << 30,
    ) -> None:
        self.config = config
        self._stub_for = stub_for
        self.max_queued_bytes = max_queued_bytes
        self._pushes: dict[str, _Push] = {}
        # Streams of cancelled pushes, ending with their abandon message.
        self._abandoning: set[asyncio.Task[bool]] = set()
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self.num_pushed = 0  # confirmed by the decode worker
        self.num_failed = 0

    # ---- event loop ---------------------------------------------------------------

    def start(
        self, request_id: str, address: str, transport: str, layout: KVLayout, num_blocks: int, first_block: int = 0
    ) -> None:
        """Open a push of blocks ``first_block``..``num_blocks`` of ``request_id`` to ``address``; before the
        engine has the request (whose hold must say the same ``push_first_block``).

        ``ValueError`` for a transport that is not pushed; a failure to set the
        push up (no room in /dev/shm) is logged and leaves the request to a pull.
        """
        if transport not in PUSH_TRANSPORTS:
            raise ValueError(f"KV push supports {', '.join(PUSH_TRANSPORTS)}, not {transport!r}")
        push = _Push(request_id, address, transport, layout, num_blocks, asyncio.get_running_loop(),
                     first_block=first_block)
        try:
            if transport == "shm":
                self._create_segment(push)
        except Exception as error:  # noqa: BLE001 - the request goes on, pulled
            log.warning("cannot push the KV of %s (%s); it will be pulled", request_id, error)
            self.num_failed += 1
            return
        with self._lock:
            previous = self._pushes.pop(request_id, None)
            self._pushes[request_id] = push
        if previous is not None:
            self._close(previous)

    async def finish(
        self, request_id: str, timeout_s: float, start: worker_pb2.KVPushStart | None = None
    ) -> bool:
        """Whether the decode worker confirmed every block, waiting at most ``timeout_s``; ends the push either way.

        ``start`` goes last in the stream, once the engine handed over every piece: the decode
        worker starts the request with it when the push is complete (``KVPushStart``).
        """
        with self._lock:
            push = self._pushes.get(request_id)
        if push is None:
            return False
        if push.task is None:  # never opened (no piece came): nothing was pushed
            self._forget(push)
            return False
        push.queue.put_nowait(_NO_START if start is None else start)
        try:
            # asyncio.wait: neither cancels the push at the timeout nor raises what ended it.
            done, _ = await asyncio.wait({push.task}, timeout=max(timeout_s, 0.0))
        finally:
            self._forget(push)
        task = push.task
        return task in done and not task.cancelled() and task.exception() is None and task.result()

    def cancel(self, request_id: str) -> None:
        """Stop pushing ``request_id`` (aborted, or nothing to hand off); the decode worker drops what it got.

        An open stream is ended with an abandon message rather than cancelled: a cancel can reach the
        decode worker as a half-close, which after the last piece would look like a complete push.
        """
        with self._lock:
            push = self._pushes.get(request_id)
            if push is not None:
                del self._pushes[request_id]
        if push is None:
            return
        if push.task is None or push.task.done():
            self._close(push)
            return
        self._stop_sending(push)
        push.abandoned = True
        push.queue.put_nowait(_ABANDON)
        self._abandoning.add(push.task)
        push.task.add_done_callback(self._abandoning.discard)

    def close(self) -> None:
        with self._lock:
            pushes = list(self._pushes.values())
        for push in pushes:
            self._forget(push)
        for task in list(self._abandoning):
            task.cancel()

    # ---- engine thread (KVPushSink) -------------------------------------------------

    def push_layer(self, request_id: str, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        push = self._pushes.get(request_id)
        if push is None or push.closed:
            return
        num_blocks = blocks.shape[2]
        if push.transport == "shm":
            with push.lock:
                if push.closed or push.tensor is None:
                    return
                # In place in the whole tensor: the receiver reads it from there.
                push.tensor[layer : layer + 1, :, first_block : first_block + num_blocks].copy_(blocks)
            piece: object = (layer, first_block, num_blocks, None)
            size = 0
        else:
            piece = (layer, first_block, num_blocks, blocks)
            size = blocks.numel() * blocks.element_size()
        with self._lock:
            if push.stopped:
                return  # stopped since the check above: nothing of it is sent any more
            over = self._queued_bytes + size > self.max_queued_bytes
            if not over:
                self._queued_bytes += size
                push.queued_bytes += size
        if over:
            log.warning("KV push of %s given up: over %d bytes queued to send; it will be pulled",
                        request_id, self.max_queued_bytes)
            push.loop.call_soon_threadsafe(self._forget, push)
            return
        if not push.opened:
            push.opened = True
            push.loop.call_soon_threadsafe(self._open, push)
        push.loop.call_soon_threadsafe(push.queue.put_nowait, piece)

    def push_end(self, request_id: str, complete: bool) -> None:
        push = self._pushes.get(request_id)
        if push is None:
            return
        if complete:
            push.loop.call_soon_threadsafe(push.queue.put_nowait, _END)
        else:
            push.loop.call_soon_threadsafe(self._forget, push)

    # ---- internals ----------------------------------------------------------------

    def _open(self, push: _Push) -> None:
        if not push.closed and push.task is None:
            push.task = push.loop.create_task(self._run(push))

    async def _run(self, push: _Push) -> bool:
        stub = self._stub_for(push.address)
        call = stub.PushKV(self._messages(push), timeout=self.config.rpc_timeout_s)
        try:
            response = await call
        except grpc.aio.AioRpcError as error:
            if push.abandoned:
                return False  # the decode worker dropped it, as asked
            log.warning("KV push of %s to %s failed (%s: %s); it will be pulled",
                        push.request_id, push.address, error.code().name, error.details())
            self.num_failed += 1
            self._stop_sending(push)  # the engine's later pieces are dropped, not queued
            return False
        except asyncio.CancelledError:
            call.cancel()
            raise
        expected = (push.num_blocks - push.first_block) * push.layout.bytes_per_block
        if response.num_blocks != push.num_blocks or response.total_bytes != expected:
            log.warning("KV push of %s: the decode worker holds %d blocks (%d bytes), expected %d (%d)",
                        push.request_id, response.num_blocks, response.total_bytes, push.num_blocks, expected)
            self.num_failed += 1
            return False
        self.num_pushed += 1
        return True

    async def _messages(self, push: _Push) -> AsyncIterator[worker_pb2.KVPushMessage]:
        header = worker_pb2.KVPushHeader(
            request_id=push.request_id, layout=layout_to_proto(push.layout), num_blocks=push.num_blocks,
            transport=push.transport, shm_segment=push.segment.name if push.segment is not None else "",
            first_block=push.first_block,
        )
        yield worker_pb2.KVPushMessage(header=header)
        step = self.config.chunk_bytes
        pieces_done = False
        ending: object = None  # what finish() queued: the start message, or _NO_START
        while not (pieces_done and ending is not None):
            item = await push.queue.get()
            if item is _ABANDON:
                yield worker_pb2.KVPushMessage(abandon=worker_pb2.KVPushAbandon())
                return
            if item is _END:
                pieces_done = True
                continue
            if item is _NO_START or isinstance(item, worker_pb2.KVPushStart):
                ending = item  # finish() may come before the engine's last pieces
                continue
            layer, first_block, num_blocks, blocks = item  # type: ignore[misc]
            if blocks is None:  # shm: the piece is in the segment already
                total = num_blocks * push.layout.bytes_per_block // push.layout.num_layers
                piece = worker_pb2.KVPushPiece(layer=layer, first_block=first_block, num_blocks=num_blocks,
                                               total_bytes=total)
                yield worker_pb2.KVPushMessage(piece=piece)
                continue
            size = blocks.numel() * blocks.element_size()
            data = byte_view(host_contiguous(blocks))
            for offset in range(0, max(data.nbytes, 1), step):
                piece = worker_pb2.KVPushPiece(
                    layer=layer, first_block=first_block, num_blocks=num_blocks, offset=offset,
                    total_bytes=data.nbytes, data=bytes(data[offset : offset + step]),
                )
                yield worker_pb2.KVPushMessage(piece=piece)
            with self._lock:
                # Nothing when the push was stopped while this piece was sent: that released it already.
                released = min(size, push.queued_bytes)
                self._queued_bytes -= released
                push.queued_bytes -= released
        if isinstance(ending, worker_pb2.KVPushStart):
            yield worker_pb2.KVPushMessage(start=ending)
        # Returning half-closes the stream: every piece (and the start) was sent.

    def _create_segment(self, push: _Push) -> None:
        size = push.num_blocks * push.layout.bytes_per_block
        segment = SharedMemory(name=self.config.shm_prefix + secrets.token_hex(8), create=True, size=size)
        try:
            _reserve(segment)
        except BaseException:
            segment.close()
            _unlink(segment)
            raise
        flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=size)
        push.segment = segment
        push.tensor = flat.view(torch_dtype_of(push.layout)).view(push.layout.tensor_shape(push.num_blocks))

    def _forget(self, push: _Push) -> None:
        """End ``push``: stop its stream (unless it completed), free its queue and segment."""
        with self._lock:
            if self._pushes.get(push.request_id) is push:
                del self._pushes[push.request_id]
        self._close(push)

    def _close(self, push: _Push) -> None:
        if push.task is not None and not push.task.done():
            push.task.cancel()
        self._stop_sending(push)

    def _stop_sending(self, push: _Push) -> None:
        """No more pieces: drop the queued ones, unmap the segment (the engine thread writes it under the lock)."""
        with self._lock:
            push.stopped = True
            self._queued_bytes -= push.queued_bytes
            push.queued_bytes = 0
        while not push.queue.empty():
            push.queue.get_nowait()
        with push.lock:
            if push.closed:
                return
            push.closed = True
            segment, push.tensor, push.segment = push.segment, None, None
        if segment is not None:
            try:
                segment.close()
            except BufferError:
                log.warning("shm segment %s still referenced; unmapped when collected", segment.name)
            # The receiver unlinked it once mapped; if it never did, this removes it.
            _unlink(segment)
