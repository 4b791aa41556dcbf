"""A tensor-parallel decode rank's own fetch: exactly its KV heads, straight from the prefill worker.

``fetch_heads`` is the fetcher a ``engine.kv_handoff.KVFetch`` names: the engine's
follower ranks call it (blocking) for the heads they own, over the handoff's
transport, so no rank's KV passes through rank 0. Each process keeps one event
loop, its channels and its receivers (a torch_dist receiver keeps its pair
groups with each prefill worker), for the life of the process.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import torch

from kv_transfer.base import KVReceiver, make_receiver
from kv_transfer.config import INTERNAL_GRPC_OPTIONS, TransferConfig
from kv_transfer.descriptor import KVHandoff
from protos.pdserve.v1.internal import worker_pb2_grpc

FETCHER = "kv_transfer.sharded:fetch_heads"


class _RankTransfers:
    """This process's loop (on a thread of its own), channels and receivers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="kv-rank-fetch", daemon=True).start()
        self.stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}
        self.receivers: dict[tuple[str, TransferConfig], KVReceiver] = {}

    async def fetch(self, handoff: KVHandoff, first_block: int, heads: range, config: TransferConfig) -> torch.Tensor:
        if handoff.address not in self.stubs:
            # Plaintext, as the internal channels of a worker without TLS (a TLS cluster: see README).
            channel = grpc.aio.insecure_channel(handoff.address, options=list(INTERNAL_GRPC_OPTIONS))
            self.stubs[handoff.address] = worker_pb2_grpc.PrefillWorkerStub(channel)
        key = (handoff.transport, config)
        if key not in self.receivers:
            self.receivers[key] = make_receiver(handoff.transport, config)
        return await self.receivers[key].fetch(handoff, first_block, self.stubs[handoff.address], heads)


_transfers: _RankTransfers | None = None
_lock = threading.Lock()


def fetch_heads(handoff: KVHandoff, first_block: int, heads: range, config: TransferConfig | None) -> torch.Tensor:
    """The handoff's blocks from ``first_block`` on, of KV heads ``heads`` only; blocks the caller until done."""
    global _transfers
    with _lock:
        if _transfers is None:
            _transfers = _RankTransfers()
        transfers = _transfers
    config = config or TransferConfig()
    future = asyncio.run_coroutine_threadsafe(transfers.fetch(handoff, first_block, heads, config), transfers.loop)
    return future.result(timeout=config.rpc_timeout_s + config.torch_dist_timeout_s)
