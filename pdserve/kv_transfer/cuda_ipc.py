"""The cuda_ipc transport: same-host GPUs share the staged tensor's device memory directly.

The sender moves (or keeps) the blocks on CUDA, makes sure they are written,
and returns a pickled ``torch.multiprocessing.reductions.reduce_tensor``
handle; it keeps the tensor alive until the lease ends (``release``), because
the receiver's mapping points at that very memory. The receiver rebuilds the
tensor from the handle, copies it into memory of its own and drops the
mapping. Both processes must number the GPUs alike (same
CUDA_VISIBLE_DEVICES): the handle names a device index.

The handle is unpickled with only torch's own names allowed, so a confused or
hostile peer cannot make the receiver import and call arbitrary code.
"""

from __future__ import annotations

import asyncio
import io
import pickle
import threading

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from pdserve.kv_transfer.base import KVReceiver, KVStager, KVTransferError, check_staged, head_fields
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.descriptor import KVHandoff
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc


def _cuda_device(config: TransferConfig) -> torch.device:
    device = torch.device(config.device)
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


class _TorchOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if module != "torch" and not module.startswith("torch."):
            raise pickle.UnpicklingError(f"cuda_ipc handle refers to {module}.{name}, outside torch")
        return super().find_class(module, name)


class CudaIpcStager(KVStager):
    name = "cuda_ipc"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._staged: dict[str, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    async def stage(self, request_id: str, blocks: torch.Tensor, peer_address: str) -> bytes:
        if not torch.cuda.is_available():
            raise KVTransferError("cuda_ipc needs CUDA on the prefill worker; use shm or grpc")
        return await asyncio.to_thread(self._stage, request_id, blocks)

    def _stage(self, request_id: str, blocks: torch.Tensor) -> bytes:
        device = blocks.device if blocks.is_cuda else _cuda_device(self.config)
        tensor = blocks.detach().to(device).contiguous()
        # An IPC handle carries no stream order: the bytes must be written before it leaves.
        torch.cuda.synchronize(device)
        rebuild, args = reduce_tensor(tensor)
        handle = pickle.dumps((rebuild, args), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._staged.setdefault(request_id, []).append(tensor)
        return handle

    def release(self, request_id: str) -> None:
        with self._lock:
            self._staged.pop(request_id, None)

    def close(self) -> None:
        with self._lock:
            self._staged.clear()


class CudaIpcReceiver(KVReceiver):
    name = "cuda_ipc"

    async def _fetch(
        self,
        handoff: KVHandoff,
        first_block: int,
        num_blocks: int,
        stub: worker_pb2_grpc.PrefillWorkerStub,
        heads: range,
    ) -> torch.Tensor:
        if not torch.cuda.is_available():
            raise KVTransferError("cuda_ipc needs CUDA on the decode worker; use shm or grpc")
        response = await stub.StageKV(
            worker_pb2.StageKVRequest(
                request_id=handoff.request_id, first_block=first_block, transport=self.name,
                **head_fields(handoff, heads),
            ),
            timeout=self.config.rpc_timeout_s,
        )
        check_staged(response, handoff, num_blocks, self.name, heads)
        return await asyncio.to_thread(self._copy_out, response.handle)

    def _copy_out(self, handle: bytes) -> torch.Tensor:
        try:
            rebuild, args = _TorchOnlyUnpickler(io.BytesIO(handle)).load()
        except Exception as exc:
            raise KVTransferError(f"unreadable cuda_ipc handle: {exc}") from exc
        if rebuild is not rebuild_cuda_tensor:
            raise KVTransferError(f"cuda_ipc handle rebuilds with {rebuild!r}, not rebuild_cuda_tensor")
        shared = rebuild(*args)
        device = _cuda_device(self.config)
        blocks = shared.to(device, copy=True)
        # The copy must be done before the mapping goes (the sender frees the memory at release).
        torch.cuda.synchronize(device)
        torch.cuda.synchronize(shared.device)
        del shared
        return blocks
