"""The prefill side's FetchKV and StageKV handlers, over a ``KVSource``.

The prefill service's servicer delegates those two RPCs here and calls
``release`` when a lease ends (ReleaseKV, expiry, abort) and ``close`` at
shutdown. Exceptions become gRPC status codes in ``_abort_for`` only.

Delegate FetchKV by binding (``self.FetchKV = kv_sender.FetchKV``) or by
re-yielding from an ``async def ... yield`` method: grpc.aio recognises a
streaming handler by being an async generator function, and a plain ``def``
returning the generator fails with UNKNOWN.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc
import torch

from pdserve.kv_transfer.base import KVSource, KVStager, KVTransferError, make_stager, requested_heads
from pdserve.kv_transfer.buffers import byte_view, host_contiguous
from pdserve.kv_transfer.config import STAGED_TRANSPORTS, TransferConfig, check_transport
from pdserve.protos.pdserve.v1.internal import worker_pb2

logger = logging.getLogger(__name__)


class KVSenderServicer:
    """Serves a prefill worker's held KV blocks over every transport.

    ``FetchKV`` streams the raw tensor (grpc transport); ``StageKV`` hands it to
    the stager of the transport asked for, created on first use. Unknown or
    expired requests end with NOT_FOUND, unknown transports with
    INVALID_ARGUMENT, transport failures with UNAVAILABLE.
    """

    def __init__(self, source: KVSource, config: TransferConfig | None = None) -> None:
        self._source = source
        self.config = config or TransferConfig()
        self._stagers: dict[str, KVStager] = {}
        # Handlers run on the event loop but release() may come from another thread.
        self._lock = threading.Lock()

    async def FetchKV(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.FetchKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KVChunk]:
        # Layer by layer, the next layer copied out of the KV cache (off the loop) while
        # this one streams: the copy overlaps the sending instead of preceding it. The
        # chunks are the same as from one export: every one `step` bytes but the last.
        num_layers, step = _num_layers(self._source, request.request_id), self.config.chunk_bytes
        total = num_blocks = offset = 0
        carry = bytearray()  # the head of a chunk that spans two layers

        def chunk(data: bytes) -> worker_pb2.KVChunk:
            return worker_pb2.KVChunk(data=data, offset=offset, total_bytes=total, num_blocks=num_blocks)

        try:
            heads = requested_heads(request.kv_head_start, request.kv_head_end)
        except ValueError as exc:
            await _abort_for(exc, context)
        pending = self._start_export(request.request_id, request.first_block, 0, heads)
        try:
            for layer in range(num_layers):
                blocks = await self._finish_export(pending, context)
                if layer + 1 < num_layers:
                    pending = self._start_export(request.request_id, request.first_block, layer + 1, heads)
                data = byte_view(blocks)
                if layer == 0:
                    total, num_blocks = data.nbytes * num_layers, blocks.shape[2]
                position = 0
                if carry:
                    position = min(step - len(carry), data.nbytes)
                    carry += data[:position]
                    if len(carry) < step:
                        continue
                    yield chunk(bytes(carry))
                    offset, carry = offset + step, bytearray()
                while data.nbytes - position >= step:
                    # bytes(): protobuf takes no memoryview; this copy is the only one before serialization.
                    yield chunk(bytes(data[position : position + step]))
                    offset, position = offset + step, position + step
                carry += data[position:]
            if carry or total == 0:
                # At least one chunk, so an empty range still tells the receiver its size.
                yield chunk(bytes(carry))
        finally:
            _discard(pending)

    async def StageKV(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.StageKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StageKVResponse:
        try:
            stager = self._stager(request.transport)
            heads = requested_heads(request.kv_head_start, request.kv_head_end)
        except ValueError as exc:
            await _abort_for(exc, context)
        blocks = await self._export(request.request_id, request.first_block, context, to_host=False, heads=heads)
        if blocks.shape[2] == 0:
            # Nothing to move (receivers never ask): no segment, no send, nothing to release.
            return worker_pb2.StageKVResponse(handle=b"", total_bytes=0, num_blocks=0)
        try:
            handle = await stager.stage(request.request_id, blocks, request.peer_address)
        except Exception as exc:  # noqa: BLE001 - every failure must end the RPC with a status
            await _abort_for(exc, context)
        total = blocks.numel() * blocks.element_size()
        return worker_pb2.StageKVResponse(handle=handle, total_bytes=total, num_blocks=blocks.shape[2])

    def release(self, request_id: str) -> None:
        """Free whatever is staged for ``request_id`` and not consumed (the lease ended)."""
        with self._lock:
            stagers = list(self._stagers.values())
        for stager in stagers:
            stager.release(request_id)

    def close(self) -> None:
        """Free everything staged (shutdown); call after the server stopped serving."""
        with self._lock:
            stagers, self._stagers = list(self._stagers.values()), {}
        for stager in stagers:
            stager.close()

    def _stager(self, transport: str) -> KVStager:
        if transport == "grpc":
            raise ValueError("the grpc transport streams with FetchKV; StageKV serves " + ", ".join(STAGED_TRANSPORTS))
        check_transport(transport, STAGED_TRANSPORTS)
        with self._lock:
            if transport not in self._stagers:
                self._stagers[transport] = make_stager(transport, self.config)
            return self._stagers[transport]

    def _start_export(
        self, request_id: str, first_block: int, layer: int, heads: range | None
    ) -> asyncio.Future[torch.Tensor]:
        """One layer's held blocks (of ``heads``), on the CPU and contiguous, copied on a worker thread."""

        def export() -> torch.Tensor:
            return host_contiguous(self._source.export(request_id, first_block, slice(layer, layer + 1), heads))

        return asyncio.ensure_future(asyncio.to_thread(export))

    async def _finish_export(
        self, pending: asyncio.Future[torch.Tensor], context: grpc.aio.ServicerContext
    ) -> torch.Tensor:
        try:
            return await pending
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _abort_for(exc, context)

    async def _export(
        self, request_id: str, first_block: int, context: grpc.aio.ServicerContext, *, to_host: bool,
        heads: range | None = None,
    ) -> torch.Tensor:
        """The held blocks (of ``heads``), contiguous (and on the CPU when ``to_host``); aborts the RPC when not held."""

        def export() -> torch.Tensor:
            blocks = self._source.export(request_id, first_block, slice(None), heads)
            return host_contiguous(blocks) if to_host else blocks.detach().contiguous()

        try:
            # Off the event loop: the copy (or device-to-host move) of a long prompt takes milliseconds.
            return await asyncio.to_thread(export)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _abort_for(exc, context)


def _num_layers(source: KVSource, request_id: str) -> int:
    """Layers of ``request_id``'s blocks: a source that holds sections of another depth (a draft
    model's KV, ``engine.kv.leases.LeaseTable``) says per id with ``num_layers_of``."""
    num_layers_of = getattr(source, "num_layers_of", None)
    return num_layers_of(request_id) if num_layers_of is not None else source.num_layers


def _discard(pending: asyncio.Future[torch.Tensor]) -> None:
    """Drop an export nobody will read (the stream ended early), without an unretrieved-exception warning."""
    if pending.done():
        if not pending.cancelled():
            pending.exception()
    else:
        pending.cancel()


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext) -> NoReturn:
    """The one place where transfer exceptions become gRPC statuses."""
    if isinstance(exc, KeyError):
        code, message = grpc.StatusCode.NOT_FOUND, f"no KV held here: {exc.args[0] if exc.args else exc}"
    elif isinstance(exc, ValueError):
        code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    elif isinstance(exc, KVTransferError):
        code, message = grpc.StatusCode.UNAVAILABLE, f"KV transport failed: {exc}"
    else:
        logger.exception("KV transfer failed", exc_info=exc)
        code, message = grpc.StatusCode.INTERNAL, f"KV transfer failed: {type(exc).__name__}: {exc}"
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # it raises; this line keeps NoReturn honest
