"""The decode worker's gRPC service."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

import grpc
import torch

from pdserve.decode_service.early_start import EarlyStart, EarlyStarts
from pdserve.decode_service.push_landing import EngineLanding
from pdserve.engine.kv.handoff import KVFetch, torch_dtype_of
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.types.handoff import KVHandoff
from pdserve.engine.types.lora import LoRARequest
from pdserve.engine.types.outputs import RequestOutput
from pdserve.engine.types.sampling_params import SamplingParams
from pdserve.kv_transfer.base import KVReceiver, KVTransferError, make_receiver
from pdserve.kv_transfer.config import INTERNAL_GRPC_OPTIONS, TransferConfig
from pdserve.kv_transfer.descriptor import handoff_from_proto
from pdserve.kv_transfer.push_inbox import PushInbox
from pdserve.kv_transfer.sharded import RankFetchOptions, rank_fetcher
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.convert import (
    finish_reason_to_proto, logprobs_to_proto, lora_from_proto, sampling_params_from_proto,
)
from pdserve.service_common.errors import Unavailable, grpc_errors
from pdserve.service_common.logs import with_request_id
from pdserve.service_common.security import TlsConfig, open_channel
from pdserve.service_common.server import ServerConfig
from pdserve.service_common.worker import LoRARPCs, WorkerConfig, WorkerRuntime, WorkerServer

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


class DecodeServicer(LoRARPCs, worker_pb2_grpc.DecodeWorkerServicer):
    """Takes a request over from a prefill worker and streams every token after the first.

    The request waits in the engine's scheduler for blocks (WAITING_FOR_REMOTE_KVS);
    once it has them, only the blocks it does not already cache are fetched,
    written in between two steps, and decoding goes on. When the prefill worker
    pushed the KV here while it prefilled (PushKV, ``DecodeRequest.kv_pushed``),
    it is already in blocks reserved for it (``pdserve.kv_transfer.push_inbox``
    reads the stream, the engine's KV connector owns the blocks): the request
    adopts them, and pulls only what the push did not leave there. A push that
    ends with its request's start (``KVPushStart``) starts the request when it
    completes, and the Decode attaches to it (``pdserve.decode_service.early_start``).

    This worker, not the gateway, ends what a handoff holds elsewhere: it
    releases the prefill worker's lease once the KV landed (or the request
    ended), and asks the decode worker a push went to, when the Decode came
    here instead (``DecodeRequest.pushed_to``), to drop it.
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
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefill_stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}
        self._background: set[asyncio.Task[object]] = set()
        self.kv_bytes_received = 0
        self.kv_receive_seconds = 0.0
        self.kv_transfers = 0
        self.kv_pushes = 0
        # An early start no Decode claims ends at the handoff deadline, as the prefill worker's lease does.
        self.early = EarlyStarts(runtime.engine.kv_handoff_timeout_s)
        runtime.metrics.watch_early_starts(self.early)
        self.inbox = PushInbox(transfer, EngineLanding(self.engine, transfer.push_inbox_bytes),
                               on_start=self._start_early)

    @grpc_errors
    @with_request_id(lambda request: request.request_id or request.handoff.request_id)
    async def Decode(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ):
        params = sampling_params_from_proto(request.sampling_params)
        prompt = list(request.prompt_token_ids)
        lora = lora_from_proto(request.lora)
        if not request.HasField("handoff"):
            resume = list(request.resume_token_ids)
            async for response in self._prefill_here(request.request_id, prompt, params, lora, resume):
                yield response
            return
        handoff = handoff_from_proto(request.handoff)
        if (lora and lora.lora_name) != (handoff.lora and handoff.lora.lora_name):
            raise ValueError(f"lora.name {lora.lora_name if lora else ''!r} is not the handoff's LoRA adapter "
                             f"{handoff.lora.lora_name if handoff.lora else ''!r}")
        if request.pushed_to and request.pushed_to != self.runtime.address:
            # The KV was pushed to another decode worker, and this one serves the request: what the push
            # holds there (and the request it started) ends now, not at the handoff deadline.
            self._drop_push_at(request.pushed_to, handoff.request_id)
        early = await self.early.claim(request)
        if early is not None:
            # Started when its push completed (KVPushStart): attach to it.
            stream, first_output = early.stream, early.first
        else:
            stub = self._stub(handoff.address)
            stream = self._import(handoff, stub, prompt, params, request.kv_pushed)
            first_output = self._first_output(stream, handoff, stub)
        try:
            try:
                first = await first_output
            finally:
                if early is not None:
                    early.release_lease()  # kept until claimed (pdserve/decode_service/early_start.py)
            # The first output holds what the prefill worker already sent: stream what comes after it.
            previous = first
            async for output in stream:
                yield _new_tokens(output, previous)
                previous = output
        finally:
            # Closing the stream now (not at garbage collection) aborts an unfinished
            # request at once when the RPC is cancelled.
            await stream.aclose()

    def _import(
        self,
        handoff: KVHandoff,
        stub: worker_pb2_grpc.PrefillWorkerStub,
        prompt: list[int],
        params: SamplingParams,
        kv_pushed: bool,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The handed-off request's outputs, the first once its KV landed. ``kv_pushed``: it adopts the KV
        pushed here; otherwise it pulls, and the engine drops any push of it (one confirmed too late for the
        prefill worker, or pushed here while the gateway sent the Decode elsewhere and back)."""
        request_id = _engine_id(handoff)
        receive_kv = functools.partial(self._receive_kv, handoff, stub, request_id=request_id)
        on_admitted = functools.partial(self._count_push, handoff)
        return self.engine.import_request(request_id, prompt, params, handoff, receive_kv, pushed=kv_pushed,
                                          on_admitted=on_admitted)

    def _count_push(self, handoff: KVHandoff, num_blocks: int) -> None:
        """The request adopted ``num_blocks`` blocks its push wrote: moved while the prefill ran, and counted as
        one transfer, as a pull is."""
        if num_blocks:
            self.kv_pushes += 1
            self._count_received(handoff.transport, num_blocks * handoff.layout.bytes_per_block, 0.0)

    async def _first_output(
        self,
        stream: AsyncGenerator[RequestOutput, None],
        handoff: KVHandoff,
        stub: worker_pb2_grpc.PrefillWorkerStub,
        release_lease: bool = True,
    ) -> RequestOutput:
        # Counted while the request waits for blocks and its KV is fetched.
        with self.runtime.admit(0):
            try:
                return await anext(stream)
            finally:
                # Once the KV landed (or will be recomputed), the prefill worker's copy is no longer needed.
                if release_lease:
                    self._release_lease(handoff, stub)

    def _start_early(self, push_request_id: str, start: worker_pb2.KVPushStart) -> None:
        """``PushInbox.on_start``: a complete push announced its request's Decode; start decoding now."""
        try:
            handoff = handoff_from_proto(start.handoff)
            params = sampling_params_from_proto(start.sampling_params)
            if handoff.request_id != push_request_id:
                raise ValueError(f"start.handoff.request_id {handoff.request_id!r} is not the push's")
        except ValueError as error:
            # Left to the Decode, which takes the push as ever.
            log.warning("the KV push of %s cannot start its request (%s)", push_request_id, error)
            return
        if not self.engine.is_alive or handoff.request_id in self.early:
            return  # the Decode takes the push as ever (one waiting here is claimed or ended by it first)
        if self.early.was_dropped(handoff.request_id):
            return  # its request ended (DropPush, Abort) while the push completed: nobody will claim it
        stub = self._stub(handoff.address)
        stream = self._import(handoff, stub, list(start.prompt_token_ids), params, kv_pushed=True)
        # The prefill worker's copy stays until the Decode claims this request: a Decode the gateway
        # sends elsewhere, or one that differs, pulls it rather than recompute the prompt.
        first = asyncio.ensure_future(self._first_output(stream, handoff, stub, release_lease=False))
        release_lease = functools.partial(self._release_lease, handoff, stub)
        abort = functools.partial(self.engine.abort, _engine_id(handoff))
        self.early.add(handoff.request_id, EarlyStart(start, stream, first, release_lease, abort))

    async def _prefill_here(self, request_id: str, prompt: list[int], params: SamplingParams,
                            lora: LoRARequest | None = None, resume: list[int] | None = None):
        """Local prefill (a DecodeRequest without handoff): compute the prompt here and stream every token.

        ``resume``: the tokens a failed worker already streamed; computed after the prompt, and only the tokens
        after them are streamed (the first response holds the first new token).

        The gateway chooses this when the prompt is short or mostly cached here
        (pdserve/gateway/disaggregation.py). Prompt logprobs come from prefill workers only.
        """
        if params.prompt_logprobs is not None:
            raise ValueError("sampling_params.prompt_logprobs needs a prefill worker: send a handoff or leave it unset")
        # Its own engine id, as for a handoff: a colocated worker may still hold the client's id under a lease.
        stream = self.engine.generate(prompt, params, f"{request_id}/local", lora_request=lora,
                                      resume_token_ids=resume or ())
        try:
            # The state at admission: the resumed tokens, already with the client.
            previous: RequestOutput | None = await anext(stream) if resume else None
            # Counted as queued work until the prompt is computed.
            with self.runtime.admit(len(prompt) + len(resume or ())):
                first = await anext(stream)
            self.runtime.metrics.prefilled(len(prompt), first.num_cached_tokens)
            output: RequestOutput | None = first
            while output is not None:
                response = _new_tokens(output, previous)
                if previous is None:
                    response.cached_prompt_tokens = output.num_cached_tokens
                yield response
                previous, output = output, await anext(stream, None)
        finally:
            # Closing the stream now aborts an unfinished request at once when the RPC is cancelled.
            await stream.aclose()

    async def _receive_kv(
        self, handoff: KVHandoff, stub: worker_pb2_grpc.PrefillWorkerStub, first_block: int, request_id: str = "",
    ) -> torch.Tensor | KVFetch | None:
        """The handoff's blocks from ``first_block`` on; None (recompute here) when they cannot be had.

        Blocks the request adopted from its push are written already; whatever they and
        the prefix cache did not cover (``first_block`` before the handoff's end) is
        fetched as for any handoff. (A request they cover entirely lands without this
        call, unless its draft KV is to be fetched: ``AsyncEngine.import_request``.)

        A tensor-parallel engine gets a ``KVFetch``: rank 0's heads, fetched here, and how
        its other ranks fetch theirs (each straight from the prefill worker, when it lands).
        A draft section this engine's draft can use is fetched beside them and
        landed first (``_receive_draft_kv``); one it cannot use is ignored.
        """
        draft = None
        if request_id and self.runtime.engine.kv_connector.accepts_draft_kv(handoff):
            draft = asyncio.ensure_future(self._receive_draft_kv(handoff, stub, request_id))
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
        finally:
            if draft is not None:
                if sys.exc_info()[0] is not None:
                    draft.cancel()  # the request fails or was cancelled: its draft KV is of no use
                await asyncio.gather(draft, return_exceptions=True)

    async def _receive_draft_kv(
        self, handoff: KVHandoff, stub: worker_pb2_grpc.PrefillWorkerStub, request_id: str
    ) -> None:
        """Fetch the handoff's draft section (every block: the draft's KV of blocks cached here may be
        missing) into the engine's draft pool; on failure the draft recomputes it, nothing else changes."""
        section = handoff.draft_section()
        assert section is not None
        try:
            blocks = await self._fetch(section, 0, stub)
            await self.engine.call(lambda engine: engine.kv_connector.fill_draft(request_id, blocks))
        except (grpc.aio.AioRpcError, KVTransferError, ValueError) as error:
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            log.warning("draft KV transfer for %s failed (%s); the draft recomputes it", handoff.request_id, detail)

    @grpc_errors
    async def PushKV(  # noqa: N802 - the gRPC method name
        self, request_iterator, context: grpc.aio.ServicerContext  # noqa: ANN001
    ) -> worker_pb2.PushKVResponse:
        if self.engine.engine.tensor_parallel_size > 1:
            # Each rank takes its own heads straight from the prefill worker (pdserve/kv_transfer/sharded.py).
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this decode worker is tensor-parallel: it pulls its KV, a push cannot land here")
        return await self.inbox.receive(request_iterator, context)

    @grpc_errors
    async def DropPush(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.DropPushRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DropPushResponse:
        self._drop_push(request.request_id)
        return worker_pb2.DropPushResponse()

    @grpc_errors
    async def Abort(  # noqa: N802 - the gRPC method name
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        if not request.HasField("handoff"):
            raise ValueError("handoff must be set: it names the prefill worker whose lease ends")
        handoff = handoff_from_proto(request.handoff)
        if request.request_id != handoff.request_id:
            raise ValueError(f"request_id {request.request_id!r} is not handoff.request_id {handoff.request_id!r}")
        self._drop_push(handoff.request_id)
        self._release_lease(handoff, self._stub(handoff.address))
        return worker_pb2.AbortResponse()

    def _drop_push(self, request_id: str) -> None:
        """Free what a push of ``request_id`` holds here, end the request it started, and refuse a push of it,
        or a start, that comes later (it may be slower than the word to drop it)."""
        if self.engine.is_alive:
            self.engine.submit(lambda engine: engine.kv_connector.drop_push(request_id, refuse_later=True))
        self.early.drop(request_id)

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
    ) -> torch.Tensor | KVFetch:
        engine = self.engine.engine
        heads = engine.local_kv_heads if engine.tensor_parallel_size > 1 else None
        if first_block == handoff.num_blocks:
            # Every block is cached here already: nothing to ask the prefill worker for.
            num_heads = None if heads is None else len(heads)
            return torch.empty(handoff.layout.tensor_shape(0, num_heads), dtype=torch_dtype_of(handoff.layout))
        started = time.perf_counter()
        blocks = await self._receiver(handoff.transport).fetch(handoff, first_block, stub, heads)
        self._count_received(handoff.transport, blocks.numel() * blocks.element_size(), time.perf_counter() - started)
        if heads is not None:
            # Counted above: rank 0's part only; the other ranks' parts move when the KV lands,
            # over channels opened as this worker's (TLS when it has TLS).
            return KVFetch(handoff, blocks, rank_fetcher(RankFetchOptions(self.transfer, self.client_tls)))
        return blocks

    def _count_received(self, transport: str, num_bytes: int, seconds: float) -> None:
        self.kv_receive_seconds += seconds
        self.kv_bytes_received += num_bytes
        self.kv_transfers += 1
        self.runtime.metrics.kv_received(transport, num_bytes, seconds)

    def _receiver(self, transport: str) -> KVReceiver:
        if transport not in self._receivers:
            self._receivers[transport] = make_receiver(transport, self.transfer)
        return self._receivers[transport]

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        if address not in self._prefill_stubs:
            self._prefill_stubs[address] = worker_pb2_grpc.PrefillWorkerStub(self._channel(address))
        return self._prefill_stubs[address]

    def _channel(self, address: str) -> grpc.aio.Channel:
        """One channel per worker this one talks to (prefill workers, and decode workers it asks to drop a push)."""
        if address not in self._channels:
            self._channels[address] = open_channel(address, self.client_tls, INTERNAL_GRPC_OPTIONS)
        return self._channels[address]

    def _release_lease(self, handoff: KVHandoff, stub: worker_pb2_grpc.PrefillWorkerStub) -> None:
        async def release() -> None:
            try:
                await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=handoff.request_id), timeout=5)
            except grpc.aio.AioRpcError as error:
                # The lease expires on its own; this only frees the blocks sooner.
                log.warning("ReleaseKV for %s failed: %s", handoff.request_id, error.code())

        self._in_background(release())

    def _drop_push_at(self, address: str, request_id: str) -> None:
        """Ask the decode worker at ``address`` to drop what a push of ``request_id`` holds there."""
        async def drop() -> None:
            try:
                stub = worker_pb2_grpc.DecodeWorkerStub(self._channel(address))
                await stub.DropPush(worker_pb2.DropPushRequest(request_id=request_id), timeout=5)
            except grpc.aio.AioRpcError as error:
                # It may be gone; an unclaimed push ends at the handoff deadline there anyway.
                log.info("DropPush of %s at %s failed: %s", request_id, address, error.code())

        self._in_background(drop())

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await self.early.close()
        for task in list(self._background):
            await asyncio.gather(task, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
        if self.engine.is_alive:
            # Whatever pushes still hold here goes back with the worker.
            await self.engine.call(lambda engine: engine.kv_connector.close())


def _engine_id(handoff: KVHandoff) -> str:
    """The engine's id of a handed-off request: its own, as in a colocated worker the prefill side
    still holds the request's KV under the client's id until the lease ends."""
    return f"{handoff.request_id}/decode"


def _new_tokens(output: RequestOutput, previous: RequestOutput | None) -> worker_pb2.DecodeResponse:
    """What ``output`` adds to ``previous`` (None: everything), as one response."""
    num_sent = len(previous.token_ids) if previous is not None else 0
    text_sent = len(previous.text) if previous is not None else 0
    logprobs_sent = len(previous.logprobs or []) if previous is not None else 0
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
    return response


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
