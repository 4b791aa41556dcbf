"""The one interface of KV transfer: a source and a stager on the prefill side, a receiver on the decode side.

A prefill worker hands ``kv_transfer.sender.KVSenderServicer`` a ``KVSource``
(its engine's lease table, the one owner of held requests) and serves FetchKV
and StageKV through it; the sender hands staged transports to a ``KVStager``
each and never calls back into the service. A decode worker builds one ``KVReceiver``
per transport name with ``make_receiver`` and calls ``fetch``. Transports are
imported on first use, so a CPU machine never touches the CUDA-only ones.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch

from pdserve.engine.kv.handoff import torch_dtype_of
from pdserve.kv_transfer.config import STAGED_TRANSPORTS, TRANSPORTS, TransferConfig, check_transport
from pdserve.kv_transfer.descriptor import KVHandoff
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc


class KVTransferError(RuntimeError):
    """A transfer failed after it started, or the two sides disagree on what moved."""


class KVSource(Protocol):
    """The prefill side's held requests, as the transports see them (``engine.kv.leases.LeaseTable``)."""

    @property
    def num_layers(self) -> int:
        """Layers of every held request's blocks (the first dimension of ``export``); a source holding
        sections of another depth (a draft model's KV) also has ``num_layers_of(request_id)``."""
        ...

    def export(
        self, request_id: str, first_block: int, layers: slice = slice(None), heads: range | None = None
    ) -> torch.Tensor:
        """The request's blocks from ``first_block`` on, of ``layers``: (layers, 2, n, block_size, num_kv_heads, head_dim);
        ``heads``: only those KV heads (global indices), for a tensor-parallel receiver rank.

        Must return a tensor the caller owns (a copy, as ``KVCache.export_blocks``
        makes): transports read it after the call returns. Called from a worker
        thread, not the event loop; a transport may export a request layer by
        layer, so that the copy overlaps the sending. Raises ``KeyError`` when
        the request is not held (unknown, released, lease expired) and
        ``ValueError`` when ``first_block`` is past its blocks.
        """
        ...


class KVStager(ABC):
    """The sending half of a staged transport (shm, torch_dist, cuda_ipc).

    ``stage`` places the blocks where the receiver will read them and returns
    the handle to put in ``StageKVResponse.handle``; anything it keeps for an
    unconsumed transfer is freed by ``release`` (lease end) or ``close``
    (shutdown), so nothing outlives a receiver that died.
    """

    name: ClassVar[str]

    def __init__(self, config: TransferConfig) -> None:
        self.config = config

    @abstractmethod
    async def stage(self, request_id: str, blocks: torch.Tensor, peer_address: str) -> bytes: ...

    def release(self, request_id: str) -> None:
        """Free what was staged for ``request_id`` and not yet consumed; idempotent."""

    def close(self) -> None:
        """Free everything staged; the stager is not used afterwards."""


class KVReceiver(ABC):
    """The decode side of one transport: fetches the blocks a decode worker lacks.

    ``fetch`` returns the handoff's blocks from ``first_block`` on, as a tensor
    of ``handoff.layout.tensor_shape(n)`` with ``n = handoff.num_blocks -
    first_block``, on the CPU or, for GPU transports, on ``config.device``.
    RPC failures propagate as ``grpc.aio.AioRpcError`` (NOT_FOUND: the prefill
    worker no longer holds the request); a transfer that breaks or disagrees
    with the handoff raises ``KVTransferError``. ``heads`` (a range of global
    KV head indices): a tensor-parallel decode rank fetches only the heads it
    owns, whatever the sender's sharding (the sender gathers them if it must).
    """

    name: ClassVar[str]

    def __init__(self, config: TransferConfig) -> None:
        self.config = config

    async def fetch(
        self,
        handoff: KVHandoff,
        first_block: int,
        stub: worker_pb2_grpc.PrefillWorkerStub,
        heads: range | None = None,
    ) -> torch.Tensor:
        if not 0 <= first_block <= handoff.num_blocks:
            raise ValueError(f"first_block must be in [0, {handoff.num_blocks}], got {first_block}")
        heads = handoff.layout.check_heads(heads)
        num_blocks = handoff.num_blocks - first_block
        if num_blocks == 0:
            # Everything is cached here already: nothing to ask the prefill worker for.
            return torch.empty(handoff.layout.tensor_shape(0, len(heads)), dtype=torch_dtype_of(handoff.layout))
        blocks = await self._fetch(handoff, first_block, num_blocks, stub, heads)
        expected = handoff.layout.tensor_shape(num_blocks, len(heads))
        if tuple(blocks.shape) != expected or blocks.dtype != torch_dtype_of(handoff.layout):
            raise KVTransferError(
                f"{self.name} transfer of {handoff.request_id!r} gave {tuple(blocks.shape)} {blocks.dtype}, "
                f"expected {expected} {torch_dtype_of(handoff.layout)}"
            )
        return blocks

    @abstractmethod
    async def _fetch(
        self,
        handoff: KVHandoff,
        first_block: int,
        num_blocks: int,
        stub: worker_pb2_grpc.PrefillWorkerStub,
        heads: range,
    ) -> torch.Tensor:
        """Move ``num_blocks`` (> 0) blocks of ``heads``; ``fetch`` has validated the range and checks the result."""

    async def close(self) -> None:
        """Free the receiver's own resources (rendezvous stores, process groups)."""


def head_fields(handoff: KVHandoff, heads: range) -> dict[str, int]:
    """The kv_head_start/kv_head_end fields of a FetchKV/StageKV request (both 0: every head)."""
    if len(heads) == handoff.layout.num_kv_heads:
        return {}
    return {"kv_head_start": heads.start, "kv_head_end": heads.stop}


def requested_heads(start: int, end: int) -> range | None:
    """The heads a FetchKV/StageKV request asks for (None: all); ValueError for an empty range."""
    if start == end == 0:
        return None
    if not start < end:
        raise ValueError(f"kv_head_start must be below kv_head_end, got [{start}, {end})")
    return range(start, end)


def check_staged(
    response: worker_pb2.StageKVResponse, handoff: KVHandoff, num_blocks: int, transport: str,
    heads: range | None = None,
) -> None:
    """Raise ``KVTransferError`` unless the sender staged exactly the blocks asked for."""
    num_heads = handoff.layout.num_kv_heads if heads is None else len(heads)
    expected_bytes = num_blocks * handoff.layout.bytes_per_block * num_heads // handoff.layout.num_kv_heads
    if response.num_blocks != num_blocks or response.total_bytes != expected_bytes:
        raise KVTransferError(
            f"{transport} staging of {handoff.request_id!r} holds {response.num_blocks} blocks "
            f"({response.total_bytes} bytes), expected {num_blocks} blocks ({expected_bytes} bytes): "
            "the handoff and the sender disagree"
        )


# Imported on first use: cuda_ipc and nccl need CUDA, torch_dist pulls in torch.distributed.
_RECEIVERS: dict[str, str] = {
    "grpc": "pdserve.kv_transfer.grpc_stream:GrpcReceiver",
    "shm": "pdserve.kv_transfer.shm:ShmReceiver",
    "torch_dist": "pdserve.kv_transfer.torch_dist:TorchDistReceiver",
    "cuda_ipc": "pdserve.kv_transfer.cuda_ipc:CudaIpcReceiver",
}
_STAGERS: dict[str, str] = {
    "shm": "pdserve.kv_transfer.shm:ShmStager",
    "torch_dist": "pdserve.kv_transfer.torch_dist:TorchDistStager",
    "cuda_ipc": "pdserve.kv_transfer.cuda_ipc:CudaIpcStager",
}


def _load(path: str) -> type:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def make_receiver(name: str, config: TransferConfig | None = None) -> KVReceiver:
    """The receiver of transport ``name`` (grpc, shm, torch_dist, cuda_ipc); ValueError for others."""
    check_transport(name, TRANSPORTS)
    return _load(_RECEIVERS[name])(config or TransferConfig())


def make_stager(name: str, config: TransferConfig | None = None) -> KVStager:
    """The stager of staged transport ``name`` (shm, torch_dist, cuda_ipc); ValueError for others."""
    check_transport(name, STAGED_TRANSPORTS)
    return _load(_STAGERS[name])(config or TransferConfig())
