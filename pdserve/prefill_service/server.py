"""The prefill worker's gRPC service."""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.types.handoff import KVHoldParams
from pdserve.engine.types.outputs import RequestOutput
from pdserve.engine.types.sampling_params import SamplingParams
from pdserve.kv_transfer.config import INTERNAL_GRPC_OPTIONS, TransferConfig
from pdserve.kv_transfer.descriptor import handoff_to_proto
from pdserve.kv_transfer.pusher import PUSH_TRANSPORTS, KVPusher
from pdserve.kv_transfer.sender import KVSenderServicer
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.convert import (
    finish_reason_to_proto, logprobs_to_proto, lora_from_proto, sampling_params_from_proto,
)
from pdserve.service_common.errors import grpc_errors
from pdserve.service_common.logs import with_request_id
from pdserve.service_common.security import TlsConfig, open_channel
from pdserve.service_common.server import ServerConfig
from pdserve.service_common.worker import LoRARPCs, WorkerConfig, WorkerRuntime, WorkerServer

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
# A lease outlives its request's deadline by this much: the Decode's trip and a pull cut off right at it.
CLAIM_MARGIN_S = 1.0


class PrefillServicer(LoRARPCs, worker_pb2_grpc.PrefillWorkerServicer):
    """Prefill with ``max_tokens=1`` and ``hold_kv``: the first token comes back, the blocks stay pinned."""

    def __init__(
        self, runtime: WorkerRuntime, transfer: TransferConfig, client_tls: TlsConfig | None = None
    ) -> None:
        self.runtime = runtime
        self.engine = runtime.async_engine
        self.transfer = transfer
        # The engine's lease table owns every held request; the transports read held
        # blocks through it (a KVSource) and hear from it when a lease ends.
        self.leases = runtime.engine.leases
        self.sender = KVSenderServicer(self.leases, transfer)
        self.leases.on_end = self.sender.release
        # KV pushed to decode workers while the prefill runs: the engine hands each layer to the pusher.
        self.client_tls = client_tls  # of the channels to decode workers; None: plaintext
        self._channels: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.DecodeWorkerStub]] = {}
        self.pusher = KVPusher(transfer, self._decode_stub, transfer.push_max_queued_bytes)
        runtime.metrics.watch_kv_pushes(self.pusher)
        runtime.engine.kv_pusher.sink = self.pusher

    @grpc_errors
    @with_request_id(lambda request: request.request_id)
    async def Prefill(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        params = sampling_params_from_proto(request.sampling_params)
        prompt = list(request.prompt_token_ids)
        lora = lora_from_proto(request.lora)
        transport = request.transport or "grpc"
        # Push while the prefill runs when the gateway chose the decode worker already, the
        # transport can push, and a second token will be needed. A tensor-parallel engine holds
        # each rank's KV heads on that rank: its decode workers pull them (pdserve/kv_transfer/sharded.py).
        push = bool(
            request.push_address and transport in PUSH_TRANSPORTS and params.max_tokens > 1 and prompt
            and request.push_address != self.runtime.address and self.runtime.engine.tensor_parallel_size == 1
        )
        layout = self.runtime.engine.kv_layout
        num_blocks = -(-len(prompt) // layout.block_size)
        # The blocks the decode worker caches are not pushed; never the last (it holds the last prompt token).
        first_block = min(request.push_cached_tokens // layout.block_size, max(num_blocks - 1, 0)) if push else 0
        # The Decode that would claim the held KV carries the client's deadline, as this call does: past it
        # nobody can, and the lease ends then rather than at the handoff deadline (a client whose deadline
        # passed between this answer and its Decode leaves a lease no worker hears of).
        remaining = context.time_remaining()
        hold = KVHoldParams(
            transport=transport,
            address=self.runtime.address,
            worker_id=self.runtime.config.worker_id,
            epoch=self.runtime.epoch,
            push=push,
            push_first_block=first_block,
            claim_deadline=None if remaining is None else time.monotonic() + remaining + CLAIM_MARGIN_S,
        )
        final = None
        # The first token only, checked against the client's max_tokens; cancelling
        # this RPC aborts the request and frees its blocks (held ones too).
        try:
            with self.runtime.admit(len(prompt)):
                if push:
                    self.pusher.start(request.request_id, request.push_address, transport, layout, num_blocks,
                                      first_block)
                async for output in self.engine.generate(
                    prompt, _first_token_params(params), request.request_id, hold_kv=hold, validate_as=params,
                    lora_request=lora,
                ):
                    final = output
            assert final is not None and final.token_ids
            return await self._answer(request, context, final, prompt, params, push)
        except BaseException:
            # Rejected, aborted or cancelled: the decode worker drops what it got, and no Decode will
            # come for what is held here (once the request finished, its abort no longer frees it).
            self.pusher.cancel(request.request_id)
            if final is not None and final.finished:
                self._release(request.request_id)
            raise

    async def _answer(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext, final: RequestOutput,
        prompt: list[int], params: SamplingParams, push: bool,
    ) -> worker_pb2.PrefillResponse:
        """The first token and the handoff; with a push, once the decode worker confirmed it (or did not in time)."""
        self.runtime.metrics.prefilled(len(prompt), final.num_cached_tokens)
        response = worker_pb2.PrefillResponse(
            first_token_id=final.token_ids[0],
            text=final.text,
            cached_prompt_tokens=final.num_cached_tokens,
        )
        if final.logprobs:
            response.logprobs.CopyFrom(logprobs_to_proto(final.logprobs)[0])
        if final.prompt_logprobs:
            response.prompt_logprobs.extend(logprobs_to_proto(final.prompt_logprobs))
        assert final.kv_handoff is not None
        if final.finish_reason == "stop" or params.max_tokens == 1:
            # The first token already ends the request: nothing to hand off, and what was pushed is dropped.
            response.finish_reason = finish_reason_to_proto(final.finish_reason)
            self.pusher.cancel(request.request_id)
            self._release(request.request_id)
            return response
        response.handoff.CopyFrom(handoff_to_proto(final.kv_handoff))
        if push:
            # Only the last layer's piece can still be on its way: wait for the decode worker's
            # confirmation (bounded; without it the decode worker pulls, the lease holds the KV).
            remaining = context.time_remaining()
            timeout = self.transfer.push_ack_timeout_s if remaining is None else min(
                self.transfer.push_ack_timeout_s, remaining)
            # The push ends with what the Decode will carry: the decode worker starts decoding when it is complete.
            start = worker_pb2.KVPushStart(prompt_token_ids=prompt, sampling_params=request.sampling_params,
                                           handoff=response.handoff)
            response.kv_pushed = await self.pusher.finish(request.request_id, timeout, start)
        return response

    @grpc_errors
    async def FetchKV(self, request: worker_pb2.FetchKVRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        async for chunk in self.sender.FetchKV(request, context):
            yield chunk

    @grpc_errors
    async def StageKV(  # noqa: N802
        self, request: worker_pb2.StageKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StageKVResponse:
        return await self.sender.StageKV(request, context)

    @grpc_errors
    async def ReleaseKV(  # noqa: N802
        self, request: worker_pb2.ReleaseKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseKVResponse:
        self._release(request.request_id)
        return worker_pb2.ReleaseKVResponse()

    @grpc_errors
    async def Load(  # noqa: N802
        self, request: worker_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadReport:
        return self.runtime.load_report()

    def _release(self, request_id: str) -> None:
        """End a lease between two steps (the lease table lives on the engine thread); idempotent."""
        if self.engine.is_alive:
            self.engine.submit(lambda engine: engine.leases.release(request_id))

    def _decode_stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        if address not in self._channels:
            channel = open_channel(address, self.client_tls, INTERNAL_GRPC_OPTIONS)
            self._channels[address] = (channel, worker_pb2_grpc.DecodeWorkerStub(channel))
        return self._channels[address][1]

    async def close(self) -> None:
        """Free every held request, everything staged and every push; after the server stopped serving."""
        if self.engine.is_alive:
            await self.engine.call(lambda engine: engine.leases.release_all())
        self.sender.close()
        self.pusher.close()
        for channel, _ in self._channels.values():
            await channel.close()


def _first_token_params(params: SamplingParams) -> SamplingParams:
    """``params`` for the first token alone: it ends where the whole request would after one token.

    ``min_tokens`` cannot exceed ``max_tokens=1``: 1 masks the first token's EOS
    and stop ids just as any larger value does, and with any ``min_tokens >= 1``
    no stop string may end the request at its first token (see
    ``LLMEngine._finish_reason``), so they are left out here.
    """
    if params.min_tokens == 0:
        return dataclasses.replace(params, max_tokens=1)
    return dataclasses.replace(params, max_tokens=1, min_tokens=1, stop=())


class PrefillServer(WorkerServer):
    """A prefill worker: engine thread, gRPC server, registry entry."""

    def __init__(
        self,
        engine: LLMEngine,
        server_config: ServerConfig,
        worker_config: WorkerConfig,
        transfer: TransferConfig | None = None,
        advertise_host: str | None = None,
        metrics_port: int | None = None,
        client_tls: TlsConfig | None = None,  # of the channels to decode workers (KV push); None: plaintext
    ) -> None:
        super().__init__(WorkerRuntime(engine, worker_config), server_config, [SERVICE_NAME], advertise_host,
                         metrics_port=metrics_port)
        self.servicer = PrefillServicer(self.runtime, transfer or TransferConfig(), client_tls)
        self.server.add_servicer(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, self.servicer)

    async def close_servicer(self) -> None:
        await self.servicer.close()
