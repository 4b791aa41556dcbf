"""The shm transport: one POSIX shared-memory segment per transfer, same host only.

The sender creates the segment, copies the blocks in, unmaps it and returns its
name; the receiver attaches, copies out, and unlinks it. The sender remembers
every segment it staged and unlinks the leftovers when the lease ends or at
shutdown, so a receiver that dies mid-way leaves nothing in /dev/shm.

Python's resource tracker registers a segment in every process that creates
*or attaches* to it and unlinks whatever is still registered when the process
exits. Here each side's registration is balanced by its own ``unlink()``
(which unregisters); when the other side unlinked first, ``_unlink`` still
unregisters, so neither tracker warns about or re-unlinks a segment it does
not own.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

from pdserve.kv_transfer.base import KVReceiver, KVStager, KVTransferError, check_staged, head_fields
from pdserve.kv_transfer.buffers import byte_view, empty_blocks, host_contiguous
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.descriptor import KVHandoff, KVLayout
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc


def _unlink(segment: SharedMemory) -> None:
    """Unlink ``segment`` and drop it from this process's resource tracker, whoever unlinked first."""
    try:
        segment.unlink()
    except FileNotFoundError:
        # The other side unlinked it; unlink() raised before unregistering.
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]


def _reserve(segment: SharedMemory) -> None:
    """Allocate the segment's pages now, so a full /dev/shm is an error here, not a SIGBUS mid-copy.

    tmpfs hands out pages lazily: writing past its capacity through the mapping
    kills the process. Containers often give /dev/shm only 64 MiB.
    """
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(segment._fd, 0, segment.size)  # type: ignore[attr-defined]
    except OSError as exc:
        raise KVTransferError(
            f"no room in /dev/shm for {segment.size} bytes of KV ({exc.strerror}); use the grpc transport "
            "or give /dev/shm more space"
        ) from exc


class ShmStager(KVStager):
    name = "shm"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        # Segments staged and perhaps not consumed yet, per request; closed (unmapped) already.
        self._staged: dict[str, list[SharedMemory]] = {}
        self._lock = threading.Lock()

    async def stage(self, request_id: str, blocks: torch.Tensor, peer_address: str) -> bytes:
        return await asyncio.to_thread(self._stage, request_id, blocks)

    def _stage(self, request_id: str, blocks: torch.Tensor) -> bytes:
        data = byte_view(host_contiguous(blocks))
        name = self.config.shm_prefix + secrets.token_hex(8)
        segment = SharedMemory(name=name, create=True, size=data.nbytes)
        try:
            _reserve(segment)
            segment.buf[: data.nbytes] = data
            with self._lock:
                self._staged.setdefault(request_id, []).append(segment)
        except BaseException:
            segment.close()
            _unlink(segment)
            raise
        # Unmapped now: the pages live on in /dev/shm until unlinked, and are freed
        # as soon as the receiver unlinks rather than when the lease ends.
        segment.close()
        return name.encode("ascii")

    def release(self, request_id: str) -> None:
        with self._lock:
            segments = self._staged.pop(request_id, [])
        for segment in segments:
            _unlink(segment)

    def close(self) -> None:
        with self._lock:
            request_ids = list(self._staged)
        for request_id in request_ids:
            self.release(request_id)


class ShmReceiver(KVReceiver):
    name = "shm"

    async def _fetch(
        self,
        handoff: KVHandoff,
        first_block: int,
        num_blocks: int,
        stub: worker_pb2_grpc.PrefillWorkerStub,
        heads: range,
    ) -> torch.Tensor:
        response = await stub.StageKV(
            worker_pb2.StageKVRequest(
                request_id=handoff.request_id, first_block=first_block, transport=self.name,
                **head_fields(handoff, heads),
            ),
            timeout=self.config.rpc_timeout_s,
        )
        check_staged(response, handoff, num_blocks, self.name, heads)
        name = response.handle.decode("ascii", errors="replace")
        if not name or "/" in name:
            raise KVTransferError(f"shm staging of {handoff.request_id!r} returned a bad segment name {name!r}")
        return await asyncio.to_thread(_consume, name, handoff.layout, num_blocks, len(heads))


def _consume(name: str, layout: KVLayout, num_blocks: int, num_heads: int | None = None) -> torch.Tensor:
    """Copy the blocks out of segment ``name``, then unmap and unlink it."""
    try:
        segment = SharedMemory(name=name)
    except FileNotFoundError:
        raise KVTransferError(f"shm segment {name!r} is gone (the lease ended before the copy)") from None
    try:
        blocks = empty_blocks(layout, num_blocks, num_heads)
        target = byte_view(blocks)
        if segment.size < target.nbytes:
            raise KVTransferError(f"shm segment {name!r} holds {segment.size} bytes, expected {target.nbytes}")
        # A released slice, so close() finds no exported pointers into the mapping.
        with segment.buf[: target.nbytes] as source:
            target[:] = source
        return blocks
    finally:
        segment.close()
        _unlink(segment)
