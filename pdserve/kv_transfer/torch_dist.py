"""The torch_dist transport: point-to-point send/recv over one two-rank process group per peer pair.

There is no global ``init_process_group``: a worker pairs with many peers, so
each (prefill, decode) pair gets its own group, built lazily and cached on
both sides. The receiver (decode side, rank 1) hosts a ``TCPStore`` on an
ephemeral port of its address toward the prefill worker and names it in
``StageKVRequest.peer_address``; both sides build the group over it on their
first transfer. gloo moves CPU tensors (any host), NCCL CUDA ones.

One transfer: the receiver calls StageKV; the sender checks it holds the
request, picks a fresh tag, returns it in ``handle`` and, in the background,
joins the pair (first time only) and posts the send; the receiver then joins
(first time only) and posts the matching recv. Nothing is posted or joined
before the sender accepts, so a refused StageKV (NOT_FOUND) leaves nothing
pending on either side, and under gloo a send nobody receives can never match
a later recv (tags). NCCL ignores tags and matches in issue order, so the
receiver runs one transfer per pair at a time and discards the pair after any
failure once StageKV was accepted (the next fetch builds a fresh store: a new
peer_address); the sender discards it after a failed join or send and refuses
that address from then on, which makes a receiver still on it start afresh.
Caveat for NCCL: a timed-out operation tears the process down by default
(TORCH_NCCL_ASYNC_ERROR_HANDLING); set it in the worker's environment.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch
import torch.distributed as dist

from pdserve.engine.kv.handoff import torch_dtype_of
from pdserve.kv_transfer.base import KVReceiver, KVStager, KVTransferError, check_staged, head_fields
from pdserve.kv_transfer.buffers import host_contiguous
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.descriptor import KVHandoff
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    # ProcessGroupNCCL is absent from CPU builds: name it for the type checker only.
    _PairGroup = dist.ProcessGroupGloo | dist.ProcessGroupNCCL

logger = logging.getLogger(__name__)
T = TypeVar("T")

_SENDER_RANK, _RECEIVER_RANK = 0, 1
_STORE_PREFIX = "pdserve_kv_pair/"
_MAX_TAG = 2**31 - 1  # gloo tags are 32-bit
_MAX_REMEMBERED_BROKEN = 4096
# StageKV refusals made before the sender accepts (nothing joined or posted): the pair is still in step.
_CLEAN_REFUSALS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"peer_address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _local_address_toward(host: str) -> str:
    """The local address the kernel routes to ``host`` from: loopback for loopback, else a real NIC.

    A connected UDP socket picks the route without sending anything; it beats
    the machine's hostname, which may resolve to 127.0.1.1 and strand a remote peer.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


def _new_group(store: dist.Store, rank: int, config: TransferConfig, local_host: str) -> _PairGroup:
    """A two-rank group over ``store``; blocks until the peer joins (or the timeout)."""
    timeout = datetime.timedelta(seconds=config.torch_dist_timeout_s)
    prefix_store = dist.PrefixStore(_STORE_PREFIX, store)
    if config.torch_dist_backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Bind where the peer can reach us, not wherever the hostname resolves.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        return dist.ProcessGroupGloo(prefix_store, rank, 2, options)
    if not dist.is_nccl_available():
        raise KVTransferError("torch_dist_backend is nccl but this torch has no NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    return dist.ProcessGroupNCCL(prefix_store, rank, 2, options)


def _wait(work: dist.Work, tensor: torch.Tensor) -> None:
    work.wait()
    if tensor.is_cuda:
        # NCCL's wait() only orders streams; synchronize so "done" means the bytes moved.
        torch.cuda.current_stream(tensor.device).synchronize()


def _in_daemon_thread(name: str, function: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """Run a blocking join, send or recv on its own daemon thread; its result as an awaitable.

    Not an executor: a gloo wait cannot be interrupted (abort() does not wake it),
    and executor threads are joined at exit, so one stale transfer would hold a
    shutting-down worker for the whole timeout.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # the awaiting side was cancelled
            return
        if error is None:
            future.set_result(result)  # type: ignore[arg-type]
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (function(*args), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


@dataclass(eq=False)
class _SenderPair:
    """The sender's side of one pair; ``lock`` orders its join and its posted sends."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    tags: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    group: _PairGroup | None = None
    broken: bool = False


class TorchDistStager(KVStager):
    name = "torch_dist"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        # Least recently used first. A receiver that went away leaves its pair here (gloo
        # keeps threads and sockets per group) until it ages out past torch_dist_max_pairs.
        self._pairs: dict[str, _SenderPair] = {}
        # Store addresses whose pair broke or aged out (an ordered set, oldest first): joining
        # one again would meet stale rendezvous keys, so the receiver is told to start afresh.
        self._broken_addresses: dict[str, None] = {}
        self._lock = threading.Lock()

    async def stage(self, request_id: str, blocks: torch.Tensor, peer_address: str) -> bytes:
        if not peer_address:
            raise ValueError("torch_dist staging needs peer_address, the receiver's rendezvous store host:port")
        _split_host_port(peer_address)
        with self._lock:
            if peer_address in self._broken_addresses:
                raise KVTransferError(f"the pair with {peer_address} broke; the receiver must rendezvous again")
            pair = self._pairs.pop(peer_address, None)
            self._pairs[peer_address] = pair = pair if pair is not None else _SenderPair()
            while len(self._pairs) > self.config.torch_dist_max_pairs:
                stale_address = next(iter(self._pairs))
                self._mark_broken(stale_address, self._pairs.pop(stale_address))
        # next() on itertools.count is atomic under the GIL; 2**31 transfers per pair before a tag repeats.
        tag = (next(pair.tags) - 1) % _MAX_TAG + 1
        # Returned before the send is posted: the receiver joins and receives only once it has the tag.
        # _send settles its own failures; the future is not awaited.
        _in_daemon_thread("kv-torch-dist-send", self._send, peer_address, pair, tag, blocks)
        return str(tag).encode("ascii")

    def _send(self, peer_address: str, pair: _SenderPair, tag: int, blocks: torch.Tensor) -> None:
        """Join the pair if new, post the send and wait until the receiver has it (or the timeout)."""
        try:
            if self.config.torch_dist_backend == "gloo":
                tensor = host_contiguous(blocks)
            else:
                device = blocks.device if blocks.is_cuda else torch.device(self.config.device)
                tensor = blocks.detach().to(device).contiguous()
            with pair.lock:
                if pair.broken:
                    raise KVTransferError("the pair broke before this send")
                if pair.group is None:
                    pair.group = self._join(peer_address)
                work = pair.group.send([tensor], _RECEIVER_RANK, tag)
            _wait(work, tensor)
        except Exception as exc:  # noqa: BLE001 - logged; the receiver sees its recv fail
            logger.warning("torch_dist send to %s failed: %s", peer_address, exc)
            self._discard(peer_address, pair)

    def _join(self, peer_address: str) -> _PairGroup:
        host, port = _split_host_port(peer_address)
        store = dist.TCPStore(
            host_name=host,
            port=port,
            is_master=False,
            timeout=datetime.timedelta(seconds=self.config.torch_dist_timeout_s),
        )
        return _new_group(store, _SENDER_RANK, self.config, _local_address_toward(host))

    def _discard(self, peer_address: str, pair: _SenderPair) -> None:
        with self._lock:
            if self._pairs.get(peer_address) is pair:
                del self._pairs[peer_address]
            self._mark_broken(peer_address, pair)

    def _mark_broken(self, peer_address: str, pair: _SenderPair) -> None:
        """Retire ``pair`` for good; call with ``self._lock`` held."""
        pair.broken = True
        self._broken_addresses[peer_address] = None
        # Stores live on ephemeral ports: an address this old will not come back.
        while len(self._broken_addresses) > _MAX_REMEMBERED_BROKEN:
            del self._broken_addresses[next(iter(self._broken_addresses))]

    def release(self, request_id: str) -> None:
        """Nothing to free: a posted send ends when received, or fails at its timeout (discarding the pair)."""

    def close(self) -> None:
        with self._lock:
            self._pairs.clear()


@dataclass(eq=False)
class _ReceiverPair:
    """The receiver's side of one pair; ``lock`` runs its transfers one at a time (NCCL matches in order)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    store: dist.TCPStore | None = None
    peer_address: str = ""
    group: _PairGroup | None = None

    def reset(self) -> None:
        # A join or recv still running holds its own references (on its daemon thread) until its timeout.
        self.store, self.peer_address, self.group = None, "", None


class TorchDistReceiver(KVReceiver):
    name = "torch_dist"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        # Keyed by the prefill worker's address and epoch (a restarted worker is a new peer),
        # least recently used first, so pairs with departed workers age out.
        self._pairs: dict[tuple[str, str, int], _ReceiverPair] = {}

    async def _fetch(
        self,
        handoff: KVHandoff,
        first_block: int,
        num_blocks: int,
        stub: worker_pb2_grpc.PrefillWorkerStub,
        heads: range,
    ) -> torch.Tensor:
        pair = self._use_pair((handoff.address, handoff.worker_id, handoff.epoch))
        async with pair.lock:
            if pair.store is None:
                self._host_store(pair, handoff.address)
            request = worker_pb2.StageKVRequest(
                request_id=handoff.request_id,
                first_block=first_block,
                transport=self.name,
                peer_address=pair.peer_address,
                **head_fields(handoff, heads),
            )
            try:
                response = await stub.StageKV(request, timeout=self.config.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _CLEAN_REFUSALS:
                    pair.reset()  # it may have been accepted, with a send now posted that we will not receive
                raise
            except BaseException:
                pair.reset()
                raise
            try:
                check_staged(response, handoff, num_blocks, self.name, heads)
                tag = int(response.handle.decode("ascii"))
                device = torch.device("cpu" if self.config.torch_dist_backend == "gloo" else self.config.device)
                blocks = torch.empty(
                    handoff.layout.tensor_shape(num_blocks, len(heads)), dtype=torch_dtype_of(handoff.layout), device=device
                )
                if pair.group is None:
                    assert pair.store is not None
                    host, _ = _split_host_port(pair.peer_address)
                    pair.group = await _in_daemon_thread(
                        "kv-torch-dist-join", _new_group, pair.store, _RECEIVER_RANK, self.config, host
                    )
                await _in_daemon_thread("kv-torch-dist-recv", self._recv, pair.group, blocks, tag)
                return blocks
            except BaseException as exc:
                pair.reset()
                if isinstance(exc, Exception) and not isinstance(exc, KVTransferError):
                    raise KVTransferError(f"torch_dist receive of {handoff.request_id!r} failed: {exc}") from exc
                raise

    def _use_pair(self, key: tuple[str, str, int]) -> _ReceiverPair:
        pair = self._pairs.pop(key, None)
        self._pairs[key] = pair = pair if pair is not None else _ReceiverPair()
        for stale_key, stale in list(self._pairs.items()):
            if len(self._pairs) <= self.config.torch_dist_max_pairs or stale_key == key:
                break
            if not stale.lock.locked():  # a pair mid-transfer stays until it is idle
                stale.reset()
                del self._pairs[stale_key]
        return pair

    def _host_store(self, pair: _ReceiverPair, prefill_address: str) -> None:
        prefill_host, _ = _split_host_port(prefill_address)
        host = _local_address_toward(prefill_host)
        pair.store = dist.TCPStore(
            host_name=host,
            port=0,  # ephemeral: every (re)built pair gets a fresh store, and so a fresh peer_address
            is_master=True,
            timeout=datetime.timedelta(seconds=self.config.torch_dist_timeout_s),
            wait_for_workers=False,
        )
        pair.peer_address = _join_host_port(host, pair.store.port)

    @staticmethod
    def _recv(group: _PairGroup, blocks: torch.Tensor, tag: int) -> None:
        _wait(group.recv([blocks], _SENDER_RANK, tag), blocks)

    async def close(self) -> None:
        for pair in self._pairs.values():
            pair.reset()
        self._pairs.clear()
