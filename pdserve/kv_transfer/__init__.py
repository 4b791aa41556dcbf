"""KV cache transfer between prefill and decode workers: one interface, transports chosen by name.

Prefill side: ``KVSenderServicer(source, config)`` serves FetchKV / StageKV.
Decode side: ``make_receiver(name, config).fetch(handoff, first_block, stub)``.
Transports: grpc (stream, any host), shm (same host), torch_dist (gloo / NCCL
point-to-point), cuda_ipc (same-host GPUs).
"""

from __future__ import annotations

from pdserve.kv_transfer.base import KVReceiver, KVSource, KVStager, KVTransferError, make_receiver, make_stager
from pdserve.kv_transfer.config import INTERNAL_GRPC_OPTIONS, MAX_CHUNK_BYTES, TRANSPORTS, TransferConfig
from pdserve.kv_transfer.descriptor import KVHandoff, KVLayout
from pdserve.kv_transfer.sender import KVSenderServicer

__all__ = [
    "INTERNAL_GRPC_OPTIONS",
    "MAX_CHUNK_BYTES",
    "TRANSPORTS",
    "KVHandoff",
    "KVLayout",
    "KVReceiver",
    "KVSenderServicer",
    "KVSource",
    "KVStager",
    "KVTransferError",
    "TransferConfig",
    "make_receiver",
    "make_stager",
]
