"""The prefill worker's gRPC service."""

from __future__ import annotations

import dataclasses
import logging
import threading

import grpc
import torch

from engine.hashing import hash_prompt_blocks
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import KVHandoff, KVLayout
from kv_transfer.sender import KVSenderServicer
from prefill_service.leases import LeaseTable
from protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from service_common.convert import finish_reason_to_proto, logprobs_to_proto, sampling_params_from_proto
from service_common.errors import grpc_errors
from service_common.logs import with_request_id
from service_common.server import ServerConfig
from service_common.worker import WorkerConfig, WorkerRuntime, WorkerServer

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """Prefill with ``max_tokens=1`` and ``hold_kv``: the first token comes back, the blocks stay pinned."""

    def __init__(self, runtime: WorkerRuntime, lease_s: float, transfer: TransferConfig) -> None:
        self.runtime = runtime
        self.engine = runtime.async_engine
        self.leases = LeaseTable(lease_s, self._end_lease)
        # Exports read held blocks from a transport thread while the engine thread
        # steps: never during or after a release, hence the lock and the leased set.
        self._export_lock = threading.Lock()
        self._leased: set[str] = set()
        self.sender = KVSenderServicer(self, transfer)
        engine = runtime.engine
        self.layout = KVLayout(
            num_layers=int(engine.hf_config.num_hidden_layers),
            num_kv_heads=engine.model.num_kv_heads,
            head_dim=engine.model.head_dim,
            block_size=engine.block_size,
            dtype=str(engine.kv_cache_dtype).removeprefix("torch."),
        )

    # KVSource, called by the transports from a worker thread.
    def export(self, request_id: str, first_block: int) -> torch.Tensor:
        """Copy a leased request's blocks without queueing behind a step (a prefill step takes seconds).

        Safe off the engine thread: pinned blocks are neither freed nor written
        while leased, and the lease cannot end while the copy runs.
        """
        with self._export_lock:
            if request_id not in self._leased:
                raise KeyError(f"request {request_id!r} holds no KV here (unknown, released or lease expired)")
            return self.runtime.engine.export_kv(request_id, first_block).blocks

    @grpc_errors
    @with_request_id(lambda request: request.request_id)
    async def Prefill(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        params = sampling_params_from_proto(request.sampling_params)
        prompt = list(request.prompt_token_ids)
        final = None
        # The first token only, checked against the client's max_tokens; cancelling
        # this RPC aborts the request and frees its blocks.
        with self.runtime.admit(len(prompt)):
            async for output in self.engine.generate(
                prompt, _first_token_params(params), request.request_id, hold_kv=True, validate_as=params
            ):
                final = output
        assert final is not None and final.token_ids
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
        if final.finish_reason == "stop" or params.max_tokens == 1:
            # The first token already ends the request: nothing to hand off.
            response.finish_reason = finish_reason_to_proto(final.finish_reason)
            self.engine.submit(lambda engine: engine.release_kv(request.request_id))
            return response
        with self._export_lock:
            self._leased.add(request.request_id)
        deadline_ms = self.leases.grant(request.request_id)
        # Computed here rather than asked of the engine thread, which is busy stepping.
        block_hashes = tuple(hash_prompt_blocks(prompt, self.layout.block_size, self.runtime.engine.model_id))
        handoff = KVHandoff(
            request_id=request.request_id,
            model_id=self.runtime.engine.model_id,
            layout=self.layout,
            block_hashes=block_hashes,
            num_tokens=len(prompt),
            first_token_id=final.token_ids[0],
            transport=request.transport or "grpc",
            address=self.runtime.address,
            lease_deadline_ms=deadline_ms,
            worker_id=self.runtime.config.worker_id,
            epoch=self.runtime.epoch,
        )
        response.handoff.CopyFrom(handoff.to_proto())
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
        self.leases.release(request.request_id)
        return worker_pb2.ReleaseKVResponse()

    @grpc_errors
    async def Load(  # noqa: N802
        self, request: worker_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadReport:
        return self.runtime.load_report()

    def _end_lease(self, request_id: str) -> None:
        with self._export_lock:
            self._leased.discard(request_id)
        self.sender.release(request_id)
        if self.engine.is_alive:
            self.engine.submit(lambda engine: engine.release_kv(request_id))


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
        lease_s: float = 30.0,
        transfer: TransferConfig | None = None,
        advertise_host: str | None = None,
        metrics_port: int | None = None,
    ) -> None:
        super().__init__(WorkerRuntime(engine, worker_config), server_config, [SERVICE_NAME], advertise_host,
                         metrics_port=metrics_port)
        self.servicer = PrefillServicer(self.runtime, lease_s, transfer or TransferConfig())
        self.server.add_servicer(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, self.servicer)

    async def close_servicer(self) -> None:
        self.servicer.leases.release_all()
        self.servicer.sender.close()
