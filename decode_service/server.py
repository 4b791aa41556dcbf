"""The decode worker's gRPC service."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc
import torch

from engine.kv_handoff import KVHandoff
from engine.llm_engine import LLMEngine
from kv_transfer.base import KVReceiver, KVTransferError, make_receiver
from kv_transfer.config import INTERNAL_GRPC_OPTIONS, TransferConfig
from kv_transfer.descriptor import handoff_from_proto
from kv_transfer.push_inbox import PushedKV, PushInbox
from protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from service_common.convert import finish_reason_to_proto, logprobs_to_proto, sampling_params_from_proto
from service_common.errors import Unavailable, grpc_errors
from service_common.logs import with_request_id
from service_common.security import TlsConfig, open_channel
from service_common.server import ServerConfig
from service_common.worker import WorkerConfig, WorkerRuntime, WorkerServer

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Takes a request over from a prefill worker and streams every token after the first.

    The request waits in the engine's scheduler for blocks (WAITING_FOR_REMOTE_KVS);
    once it has them, only the blocks it does not already cache are fetched,
    written in between two steps, and decoding goes on. When the prefill worker
    pushed the KV here while it prefilled (PushKV, ``DecodeRequest.kv_pushed``),
    the blocks come from the push inbox instead, and are pulled only when the
    pushed copy is not there.
    """

    FAILURE_POLICIES = ("recompute", "fail")

    def __init__(
        self,
        runtime: WorkerRuntime,
        transfer: TransferConfig,
        kv_failure_policy: str = "recompute",
        client_tls: TlsConfig | None = None,
    ) -> None:
        if kv_failure_policy not in self.FAILURE_POLICIES:
            raise ValueError(f"kv_failure_policy must be one of {self.FAILURE_POLICIES}, got {kv_failure_policy!r}")
        self.kv_failure_policy = kv_failure_policy
        self.kv_recomputes = 0
        self.runtime = runtime
        self.engine = runtime.async_engine
        self.transfer = transfer
        self.client_tls = client_tls  # of the channels to prefill workers; None: plaintext
        self._receivers: dict[str, KVReceiver] = {}
        self._channels: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.PrefillWorkerStub]] = {}
        self._background: set[asyncio.Task[object]] = set()
        self.kv_bytes_received = 0
        self.kv_receive_seconds = 0.0
        self.kv_transfers = 0
        self.kv_pushes = 0
        self.inbox = PushInbox(transfer, transfer.push_inbox_bytes, transfer.push_ttl_s)

    @grpc_errors
    @with_request_id(lambda request: request.request_id or request.handoff.request_id)
    async def Decode(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ):
        params = sampling_params_from_proto(request.sampling_params)
        handoff = handoff_from_proto(request.handoff)
        prompt = list(request.prompt_token_ids)
        stub = self._stub(handoff.address)
        # Its own engine id: in a colocated worker the prefill side still holds the
        # request's KV under the client's id until the lease ends.
        request_id = f"{handoff.request_id}/decode"
        pushed: list[PushedKV] = []  # what the push inbox handed this request, freed once landed
        if request.kv_pushed:
            receive_kv = functools.partial(self._receive_pushed, handoff, stub, pushed)
        else:
            receive_kv = functools.partial(self._receive_kv, handoff, stub)
        # Counted while the request waits for blocks and its KV is fetched.
        with self.runtime.admit(0):
            stream = self.engine.import_request(request_id, prompt, params, handoff, receive_kv)
            try:
                # Once the KV landed (or will be recomputed), the prefill worker's copy is no longer needed.
                first = await anext(stream)
            finally:
                self._release_lease(handoff, stub)
                for entry in pushed:
                    self.inbox.release(entry)
                if request.kv_pushed:
                    self.inbox.discard(handoff.request_id)  # an unclaimed push (the request failed first)
        num_sent, text_sent, logprobs_sent = len(first.token_ids), len(first.text), len(first.logprobs or [])
        try:
            async for output in stream:
                response = worker_pb2.DecodeResponse(
                    token_ids=output.token_ids[num_sent:],
                    text=output.text[text_sent:],
                    finish_reason=finish_reason_to_proto(output.finish_reason),
                )
                if output.logprobs:
                    response.logprobs.extend(logprobs_to_proto(output.logprobs[logprobs_sent:]))
                if output.spec_decode_stats is not None:
                    stats = output.spec_decode_stats
                    response.spec_decode_drafts = stats.num_drafts
                    response.spec_decode_draft_tokens = stats.num_draft_tokens
                    response.spec_decode_accepted_tokens = stats.num_accepted_tokens
                num_sent, text_sent = len(output.token_ids), len(output.text)
                logprobs_sent = len(output.logprobs or [])
                yield response
        finally:
            # Closing the stream now (not at garbage collection) aborts an unfinished
            # request at once when the RPC is cancelled.
            await stream.aclose()

    async def _receive_kv(
        self, handoff: KVHandoff, stub: worker_pb2_grpc.PrefillWorkerStub, first_block: int
    ) -> torch.Tensor | None:
        """The handoff's blocks from ``first_block`` on; None (recompute here) when they cannot be had."""
        try:
            return await self._fetch(handoff, first_block, stub)
        except (grpc.aio.AioRpcError, KVTransferError) as error:
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            if self.kv_failure_policy == "fail":
                raise Unavailable(f"KV transfer from {handoff.address} failed: {detail}") from error
            # Never a truncated or corrupted answer: recompute the prompt here instead.
            log.warning("KV transfer for %s failed (%s); recomputing its prompt here", handoff.request_id, detail)
            self.kv_recomputes += 1
            return None

    async def _receive_pushed(
        self, handoff: KVHandoff, stub: worker_pb2_grpc.PrefillWorkerStub, pushed: list[PushedKV], first_block: int
    ) -> torch.Tensor | None:
        """The handoff's blocks from ``first_block`` on, out of what was pushed here; pulled when that is gone."""
        started = time.perf_counter()
        entry = self.inbox.take(handoff)
        if entry is None:
            log.warning("the KV of %s was pushed but is not here (dropped or expired); pulling it",
                        handoff.request_id)
            return await self._receive_kv(handoff, stub, first_block)
        pushed.append(entry)
        blocks = entry.blocks[:, :, first_block:]
        seconds = time.perf_counter() - started
        num_bytes = blocks.numel() * blocks.element_size()
        self.kv_pushes += 1
        self.kv_transfers += 1
        self.kv_receive_seconds += seconds
        self.kv_bytes_received += num_bytes
        self.runtime.metrics.kv_received(handoff.transport, num_bytes, seconds)
        return blocks

    @grpc_errors
    async def PushKV(  # noqa: N802 - the gRPC method name
        self, request_iterator, context: grpc.aio.ServicerContext  # noqa: ANN001
    ) -> worker_pb2.PushKVResponse:
        return await self.inbox.receive(request_iterator, context)

    @grpc_errors
    async def Load(  # noqa: N802
        self, request: worker_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadReport:
        report = self.runtime.load_report()
        report.kv_pushes = self.kv_pushes
        report.kv_bytes_received = self.kv_bytes_received
        report.kv_receive_seconds = self.kv_receive_seconds
        report.kv_transfers = self.kv_transfers
        report.kv_recomputes = self.kv_recomputes
        return report

    async def _fetch(
        self, handoff: KVHandoff, first_block: int, stub: worker_pb2_grpc.PrefillWorkerStub
    ) -> torch.Tensor:
        if first_block == handoff.num_blocks:
            # Every block is cached here already: nothing to ask the prefill worker for.
            return torch.empty(handoff.layout.tensor_shape(0), dtype=handoff.layout.torch_dtype)
        started = time.perf_counter()
        blocks = await self._receiver(handoff.transport).fetch(handoff, first_block, stub)
        seconds, num_bytes = time.perf_counter() - started, blocks.numel() * blocks.element_size()
        self.kv_receive_seconds += seconds
        self.kv_bytes_received += num_bytes
        self.kv_transfers += 1
        self.runtime.metrics.kv_received(handoff.transport, num_bytes, seconds)
        return blocks

    def _receiver(self, transport: str) -> KVReceiver:
        if transport not in self._receivers:
            self._receivers[transport] = make_receiver(transport, self.transfer)
        return self._receivers[transport]

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        if address not in self._channels:
            channel = open_channel(address, self.client_tls, INTERNAL_GRPC_OPTIONS)
            self._channels[address] = (channel, worker_pb2_grpc.PrefillWorkerStub(channel))
        return self._channels[address][1]

    def _release_lease(self, handoff: KVHandoff, stub: worker_pb2_grpc.PrefillWorkerStub) -> None:
        async def release() -> None:
            try:
                await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=handoff.request_id), timeout=5)
            except grpc.aio.AioRpcError as error:
                # The lease expires on its own; this only frees the blocks sooner.
                log.warning("ReleaseKV for %s failed: %s", handoff.request_id, error.code())

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            await asyncio.gather(task, return_exceptions=True)
        for channel, _ in self._channels.values():
            await channel.close()
        self.inbox.close()


class DecodeServer(WorkerServer):
    """A decode worker: engine thread, gRPC server, registry entry."""

    def __init__(
        self,
        engine: LLMEngine,
        server_config: ServerConfig,
        worker_config: WorkerConfig,
        transfer: TransferConfig | None = None,
        advertise_host: str | None = None,
        kv_failure_policy: str = "recompute",
        client_tls: TlsConfig | None = None,
        metrics_port: int | None = None,
    ) -> None:
        super().__init__(WorkerRuntime(engine, worker_config), server_config, [SERVICE_NAME], advertise_host,
                         metrics_port=metrics_port)
        self.servicer = DecodeServicer(self.runtime, transfer or TransferConfig(), kv_failure_policy, client_tls)
        self.server.add_servicer(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, self.servicer)

    async def close_servicer(self) -> None:
        await self.servicer.close()
