"""A tensor-parallel decode rank's own fetch: exactly its KV heads, straight from the prefill worker.

``fetch_heads`` is the fetcher a ``pdserve.engine.types.handoff.KVFetch`` carries
(``rank_fetcher`` binds the options; the decode service passes it in, so the
engine imports no transport): the engine's
follower ranks call it (blocking) for the heads they own, over the handoff's
transport, so no rank's KV passes through rank 0. Each process keeps one event
loop, its channels and its receivers (a torch_dist receiver keeps its pair
groups with each prefill worker), for the life of the process.

Its channels are opened as the decode worker's rank 0 opens its own
(``RankFetchOptions.tls``: the worker's ``--tls-ca`` / ``--tls-client-*``), so a
TLS cluster's follower ranks speak TLS too and never fall back to plaintext.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kv_transfer.base import KVReceiver, make_receiver
from pdserve.kv_transfer.config import INTERNAL_GRPC_OPTIONS, TransferConfig
from pdserve.kv_transfer.descriptor import KVHandoff
from pdserve.protos.pdserve.v1.internal import worker_pb2_grpc
from pdserve_client.channels import TlsConfig, open_channel


@dataclass(frozen=True)
class RankFetchOptions:
    """How a follower rank reaches the prefill worker: the decode worker's transfer settings and
    the TLS client configuration of its channels (None: plaintext, as the worker's own)."""

    transfer: TransferConfig = field(default_factory=TransferConfig)
    tls: TlsConfig | None = None


class _RankTransfers:
    """This process's loop (on a thread of its own), channels and receivers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="kv-rank-fetch", daemon=True).start()
        self.stubs: dict[tuple[str, TlsConfig | None], worker_pb2_grpc.PrefillWorkerStub] = {}
        self.receivers: dict[tuple[str, TransferConfig], KVReceiver] = {}

    async def fetch(
        self, handoff: KVHandoff, first_block: int, heads: range, options: RankFetchOptions
    ) -> torch.Tensor:
        channel_key = (handoff.address, options.tls)
        if channel_key not in self.stubs:
            channel = open_channel(handoff.address, options.tls, INTERNAL_GRPC_OPTIONS)
            self.stubs[channel_key] = worker_pb2_grpc.PrefillWorkerStub(channel)
        key = (handoff.transport, options.transfer)
        if key not in self.receivers:
            self.receivers[key] = make_receiver(handoff.transport, options.transfer)
        return await self.receivers[key].fetch(handoff, first_block, self.stubs[channel_key], heads)


_transfers: _RankTransfers | None = None
_lock = threading.Lock()


def rank_fetcher(options: RankFetchOptions) -> Callable[[KVHandoff, int, range], torch.Tensor]:
    """``fetch_heads`` with ``options`` bound: what a ``KVFetch`` carries to the other ranks (picklable)."""
    return functools.partial(fetch_heads, options=options)


def fetch_heads(
    handoff: KVHandoff, first_block: int, heads: range, options: RankFetchOptions | None = None
) -> torch.Tensor:
    """The handoff's blocks from ``first_block`` on, of KV heads ``heads`` only; blocks the caller until done."""
    global _transfers
    with _lock:
        if _transfers is None:
            _transfers = _RankTransfers()
        transfers = _transfers
    options = options or RankFetchOptions()
    if not isinstance(options, RankFetchOptions):
        raise TypeError(f"fetch_heads takes RankFetchOptions, got {type(options).__name__}")
    config = options.transfer
    future = asyncio.run_coroutine_threadsafe(transfers.fetch(handoff, first_block, heads, options), transfers.loop)
    return future.result(timeout=config.rpc_timeout_s + config.torch_dist_timeout_s)
