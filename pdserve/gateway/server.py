"""The public Generation service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from pdserve.cluster_index import PrefixIndexLookup, WorkerRegistry, connect
from pdserve.gateway.decode_stream import DecodeStream, MigrationPolicy
from pdserve.gateway.disaggregation import LOCAL, DisaggregationPolicy, RouteDecision
from pdserve.gateway.http_api import DEFAULT_MAX_BODY_BYTES, OpenAIHttpApi
from pdserve.gateway.lora import LoRAAdapters, UnknownAdapter, load_everywhere, unload_everywhere
from pdserve.gateway.migration import migrate
from pdserve.gateway.openai_protocol import DEFAULT_MAX_N
from pdserve.gateway.prefill_route import Route, choose_route, learn, stream_local_prefill
from pdserve.gateway.reasoning_parsers import reasoning_parser as build_reasoning_parser
from pdserve.gateway.router import NoWorkerAvailable, PrefillChoice, Router
from pdserve.gateway.tool_parsers import tool_parser
from pdserve.gateway.validation import DEFAULT_MAX_LOGPROBS, RequestLimits, validate_generate_request
from pdserve.gateway.workers import Inflight, WorkerHandle, WorkerPool
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.errors import Overloaded, Unavailable, grpc_errors
from pdserve.service_common.logs import request_id_context
from pdserve.service_common.metrics import GatewayMetrics, MetricsEndpoint
from pdserve.service_common.security import TlsConfig, server_ssl_context
from pdserve.service_common.server import Server, ServerConfig

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# The transports a prefill worker pushes KV over (kv_transfer.pusher's; the gateway imports no torch).
PUSH_TRANSPORTS = ("grpc", "shm")


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Tokenize, validate, route, prefill (first token streamed at once), then relay the decode stream."""

    def __init__(
        self,
        router: Router,
        tokenizer: Any,
        transport: str,
        limits: RequestLimits | None = None,
        admission: Admission | None = None,
        max_prefill_attempts: int = 3,
        metrics: GatewayMetrics | None = None,
        disaggregation: DisaggregationPolicy | None = None,
        kv_push: bool = True,
        max_decode_attempts: int = 2,
        lora_adapters: LoRAAdapters | None = None,
        migration: MigrationPolicy = MigrationPolicy(),
    ) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.transport = transport
        self.limits = limits or RequestLimits()
        self.admission = admission or Admission()
        self.max_prefill_attempts = max_prefill_attempts
        # Choose the decode worker before the prefill, so the prefill worker pushes the KV there as it computes it.
        self.kv_push = kv_push and transport in PUSH_TRANSPORTS
        self.max_decode_attempts = max_decode_attempts
        # Moves of a stream to another decode worker when its own fails mid-stream (0: the stream ends instead).
        self.migration = migration
        self.metrics = metrics or GatewayMetrics()
        self.disaggregation = disaggregation or DisaggregationPolicy()
        # The LoRA adapters requests may name (lora_name); none unless the gateway serves LoRA.
        self.lora_adapters = lora_adapters or LoRAAdapters(enabled=False)
        self._background: set[asyncio.Task[None]] = set()

    @grpc_errors
    async def Generate(  # noqa: N802 - the gRPC method name
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        request_id = request.request_id or f"gw-{uuid.uuid4().hex}"
        with request_id_context(request_id), self.metrics.track(lambda: _deadline_passed(context)) as tracker:
            token_ids = self.prompt_token_ids(request)
            validate_generate_request(request, token_ids, self._request_limits())
            assert token_ids is not None  # validation rejects a prompt it could not tokenize
            lora = self.lora_of(request.lora_name)
            lora_name = lora.name if lora is not None else None
            log.debug("generate: %d prompt tokens, max_tokens %d", len(token_ids), request.sampling_params.max_tokens)
            with self.admission.admit(len(token_ids)):
                route = await choose_route(self.disaggregation, self.router, self.metrics, request, token_ids,
                                           lora_name)
                stream = DecodeStream(self.router, self.metrics, self.migration, request, request_id, token_ids, lora,
                                      context.time_remaining)
                if route.decision.local:
                    responses = stream_local_prefill(stream, route)
                else:
                    push_to = self._push_target(request, route.decode, lora_name)
                    push_cached = await self._push_cached_tokens(route, push_to, token_ids, lora_name)
                    try:
                        prefill_response = await self._prefill(request, request_id, token_ids, context,
                                                               route.prefill, push_to, push_cached, lora)
                    except PrefillWorkersFailed:
                        # Every prefill worker failed it: --disaggregation auto prefills on a decode worker.
                        if (self.disaggregation.mode != "auto"
                                or request.sampling_params.HasField("prompt_logprobs")):
                            raise
                        route = Route(RouteDecision(LOCAL, "no_prefill_worker"),
                                      decode=self._decode_for_local(lora_name))
                        self.metrics.prefill_routed(LOCAL, "no_prefill_worker")
                        responses = stream_local_prefill(stream, route)
                    else:
                        responses = self._relay(stream, prefill_response, push_to)
                async with contextlib.aclosing(responses):  # closed now, not at garbage collection, on a cancel
                    async for response in responses:
                        tracker.responded(response)
                        route.timing.responded(response)
                        yield response
                learn(self.disaggregation, route)

    async def _prefill(
        self,
        request: generation_pb2.GenerateRequest,
        request_id: str,
        token_ids: list[int],
        context: grpc.aio.ServicerContext,
        choice: PrefillChoice | None = None,
        push_to: WorkerHandle | None = None,
        push_cached_tokens: int = 0,
        lora: worker_pb2.LoRAAdapter | None = None,
    ) -> worker_pb2.PrefillResponse:
        """Prefill on the best worker (``choice``, when routing chose it already); when one is unreachable
        (crashed, partitioned), on the next best.

        ``push_to``: the decode worker the prefill worker pushes the KV to while it computes it;
        ``push_cached_tokens``: what that worker caches of the prompt (not pushed).
        """
        prefill_request = worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=request.sampling_params,
            transport=self.transport,
            lora=lora,
        )
        failed: set[str] = set()
        while True:
            try:
                if choice is None or failed:
                    choice = await self.router.choose_prefill(token_ids, exclude=failed,
                                                              lora_name=lora.name if lora is not None else None)
            except NoWorkerAvailable as error:
                if failed:
                    raise PrefillWorkersFailed(f"every prefill worker failed this request ({error})") from error
                raise Unavailable(str(error)) from error
            prefill = choice.worker
            self.metrics.routed("prefill", prefill.worker_id)
            # A colocated worker finds the prompt in its own prefix cache: nothing to push.
            pushing = push_to is not None and push_to.address != prefill.address
            prefill_request.push_address = push_to.address if pushing else ""
            prefill_request.push_cached_tokens = push_cached_tokens if pushing else 0
            try:
                # Count the work this adds there: the tokens its cache does not already hold
                # (all of them when the prompt's logprobs are asked for: those skip the cache).
                cached = 0 if request.sampling_params.HasField("prompt_logprobs") else choice.expected_cached_tokens
                with Inflight(prefill, len(token_ids) - cached):
                    response = await prefill.stub.Prefill(prefill_request, timeout=context.time_remaining())
                self.router.prefilled(choice)
                return response
            except BaseException as error:
                # A cancelled or failed Prefill frees what it held on the prefill worker, and drops what it
                # pushed (the worker cancels its push); a retry pushes again, replacing it there.
                retry = (isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
                         and len(failed) + 1 < self.max_prefill_attempts)
                if not retry:
                    raise
                # Nothing was streamed yet, so the request can start over elsewhere.
                log.warning("prefill worker %s failed for %s (%s); retrying on another worker",
                            prefill.address, request_id, error.details())
                prefill.healthy = False
                failed.add(prefill.address)
                self.metrics.retried("prefill")

    async def _relay(
        self,
        stream: DecodeStream,
        prefill_response: worker_pb2.PrefillResponse,
        push_to: WorkerHandle | None = None,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The first token at once, then the decode worker's stream, ending with usage.

        The decode worker is ``push_to`` (chosen before the prefill) when there is one. One that
        fails before sending anything is replaced by another, which pulls the KV (still leased).
        The gateway manages no KV: the decode worker serving the request releases the prefill
        worker's lease, and tells ``push_to`` to drop its push when it is not ``push_to``
        (``DecodeRequest.pushed_to``); whatever no Decode ever reaches ends at the handoff deadline.
        """
        usage = stream.usage
        usage.completion_tokens, usage.cached_prompt_tokens = 1, prefill_response.cached_prompt_tokens
        stream.generated.append(prefill_response.first_token_id)
        first = generation_pb2.GenerateResponse(
            request_id=stream.request_id, token_ids=[prefill_response.first_token_id], text=prefill_response.text
        )
        if prefill_response.HasField("logprobs"):
            first.logprobs.append(prefill_response.logprobs)
        # Only here: the decode worker (even when it recomputes the prompt) never sends them.
        first.prompt_logprobs.extend(prefill_response.prompt_logprobs)
        if prefill_response.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
            # The first token ended it: the prefill worker released its KV and dropped its push.
            first.finish_reason = prefill_response.finish_reason
            first.usage.CopyFrom(usage)
            yield first
            return

        # A completed push shows push_to answered a moment ago, and the KV (and the request the push
        # started) is there: an unhealthy mark from an older missed poll does not outweigh that. If
        # push_to has failed after all, the Decode there fails and is retried on another worker.
        decode = push_to if push_to is not None and (push_to.healthy or prefill_response.kv_pushed) else None
        decode_request = worker_pb2.DecodeRequest(
            request_id=stream.request_id,
            prompt_token_ids=stream.token_ids,
            sampling_params=stream.request.sampling_params,
            handoff=prefill_response.handoff,
            # The prefill worker pushed only to push_to; any other decode worker pulls.
            kv_pushed=prefill_response.kv_pushed and decode is not None,
            lora=stream.lora,
        )
        attempts = 0
        answered = False  # a decode worker sent a token back: it holds (and ends) what the handoff holds
        try:
            while True:
                attempts += 1
                if decode is None:
                    try:
                        decode = self.router.choose_decode(stream.lora_name)
                    except NoWorkerAvailable as error:
                        raise Unavailable(str(error)) from error
                # Served elsewhere: the decode worker that serves it has push_to drop what the push holds there
                # (and the request it started, computing tokens nobody reads).
                decode_request.pushed_to = push_to.address if push_to is not None and decode is not push_to else ""
                # Open the decode stream (it starts taking the KV) before the first token
                # goes out, so the two overlap; the client never waits for it.
                relayed = stream.relay(decode, decode_request, lead=first if attempts == 1 else None)
                async with contextlib.aclosing(relayed):
                    async for response in relayed:
                        answered = stream.received
                        yield response
                if stream.failure is None:
                    return
                if stream.received or attempts >= self.max_decode_attempts:
                    # The client has tokens: the stream moves to another decode worker, which
                    # computes them after the prompt and continues (pdserve/gateway/migration.py).
                    break
                # Nothing came from it yet: another decode worker pulls the KV the prefill worker holds.
                log.warning("decode worker %s failed for %s (%s); retrying on another worker",
                            decode.address, stream.request_id, stream.failure.details())
                self.metrics.retried("decode")
                decode, decode_request.kv_pushed = None, False
            rest = migrate(stream)
            async with contextlib.aclosing(rest):
                async for response in rest:
                    yield response
        finally:
            if not stream.finished and not answered:
                # Cancelled, past its deadline, or failed before any decode worker answered: the Decode may
                # never have reached one, so the client's end is relayed to the decode worker it went to (or
                # the push target), which ends what the handoff holds there and on the prefill worker.
                target = decode or push_to
                if target is not None:
                    self._relay_abort(target, decode_request)

    def _relay_abort(self, decode: WorkerHandle, decode_request: worker_pb2.DecodeRequest) -> None:
        """Tell ``decode`` that the request of ``decode_request`` ended before it answered (``Abort``)."""
        request = worker_pb2.AbortRequest(request_id=decode_request.handoff.request_id, handoff=decode_request.handoff)

        async def abort() -> None:
            try:
                await decode.stub.Abort(request, timeout=5)
            except grpc.aio.AioRpcError as error:
                # It may be gone; what the handoff holds ends at the handoff deadline anyway.
                log.info("Abort of %s at %s failed: %s", request.request_id, decode.address, error.code())

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _push_cached_tokens(self, route: Route, push_to: WorkerHandle | None, token_ids: list[int],
                                  lora_name: str | None = None) -> int:
        """What ``push_to`` caches of the prompt, by the prefix index (auto routing looked it up already)."""
        if push_to is None:
            return 0
        if route.inputs is not None and route.decode is push_to:
            return route.inputs.local_cached_tokens
        hashes = route.prefill.block_hashes if route.prefill is not None else ()
        return await self.router.decode_cached_tokens(push_to, token_ids, hashes, lora_name)

    def _push_target(
        self, request: generation_pb2.GenerateRequest, chosen: WorkerHandle | None = None, lora_name: str | None = None
    ) -> WorkerHandle | None:
        """The decode worker chosen before the prefill (``chosen``: the one routing weighed), for the
        prefill worker to push the KV to; None: pull."""
        if not self.kv_push or request.sampling_params.max_tokens == 1:
            return None
        if chosen is not None and chosen.healthy:
            return chosen
        try:
            return self.router.choose_decode(lora_name)
        except NoWorkerAvailable:
            return None  # _relay says so, if a decode worker is needed at all

    @grpc_errors
    async def ModelInfo(  # noqa: N802
        self, request: generation_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfoResponse:
        workers = self.router.pool.healthy("prefill") + self.router.pool.healthy("decode")
        report = next((w.report for w in workers if w.report is not None), None)
        if report is None:
            raise Unavailable("no worker is available to describe the model")
        return generation_pb2.ModelInfoResponse(
            model_id=report.model_id,
            max_context_length=report.max_model_len,
            block_size=report.block_size,
            vocab_size=report.vocab_size,
            eos_token_ids=report.eos_token_ids,
        )

    def _decode_for_local(self, lora_name: str | None) -> WorkerHandle:
        try:
            return self.router.choose_decode(lora_name)
        except NoWorkerAvailable as error:
            raise Unavailable(str(error)) from error

    def lora_of(self, lora_name: str) -> worker_pb2.LoRAAdapter | None:
        """The adapter a request's ``lora_name`` names (None: empty, the base model); ``UnknownAdapter``
        (NOT_FOUND) when this gateway does not serve it."""
        if not lora_name:
            return None
        if not self.lora_adapters.enabled:
            raise UnknownAdapter(f"lora_name {lora_name!r}: this server serves no LoRA adapters (start it with "
                                 "--enable-lora and --lora-modules)")
        return self.lora_adapters.get(lora_name).to_proto()

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """``/v1/load_lora_adapter``: see ``pdserve.gateway.lora.load_everywhere``."""
        await load_everywhere(self.router.pool, self.lora_adapters, name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        """``/v1/unload_lora_adapter``: see ``pdserve.gateway.lora.unload_everywhere``."""
        await unload_everywhere(self.router.pool, self.lora_adapters, name)

    def prompt_token_ids(self, request: generation_pb2.GenerateRequest) -> list[int] | None:
        """The prompt as token ids; None for a text prompt this gateway cannot tokenize.

        Which of prompt and prompt_token_ids must be set is checked by validation.
        """
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if request.prompt and self.tokenizer is not None:
            return list(self.tokenizer(request.prompt, add_special_tokens=True)["input_ids"])
        return None if request.prompt else []

    def _request_limits(self) -> RequestLimits:
        """The configured limits plus the model's, once a worker has reported them.

        The smallest reported values: a request must fit its prefill and its decode worker.
        """
        workers = self.router.pool.healthy("prefill") + self.router.pool.healthy("decode")
        reports = [w.report for w in workers if w.report is not None]
        if not reports:
            return self.limits
        return self.limits.for_model(min(r.vocab_size for r in reports), min(r.max_model_len for r in reports))


class PrefillWorkersFailed(Unavailable):
    """A request's prefill failed on every prefill worker there is (each UNAVAILABLE): nothing was sent yet."""


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


class Admission:
    """The gateway's admission limits: past them a request gets RESOURCE_EXHAUSTED at once.

    Counts requests in flight through this gateway and their prompt tokens, so
    a burst cannot grow queues (and memory) without bound. An idle gateway
    admits any single request.
    """

    def __init__(self, max_requests: int = 1024, max_tokens: int = 1 << 20) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise ValueError("admission limits must be >= 1")
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = self.tokens = 0

    @contextlib.contextmanager
    def admit(self, num_tokens: int) -> Iterator[None]:
        if self.requests and (self.requests + 1 > self.max_requests or self.tokens + num_tokens > self.max_tokens):
            raise Overloaded(
                f"the gateway is over its admission limit ({self.requests} requests, {self.tokens} prompt tokens "
                "in flight); retry later"
            )
        self.requests += 1
        self.tokens += num_tokens
        try:
            yield
        finally:
            self.requests -= 1
            self.tokens -= num_tokens


class GatewayServer:
    """The gateway process: worker pool, router, public server."""

    def __init__(
        self,
        server_config: ServerConfig,
        tokenizer: Any,
        prefill_addresses: list[str] = (),  # type: ignore[assignment]
        decode_addresses: list[str] = (),  # type: ignore[assignment]
        redis_url: str | None = None,
        redis_prefix: str = "pdserve",
        transport: str = "grpc",
        poll_s: float = 0.5,
        routing: str = "prefix",
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        max_inflight_requests: int = 1024,
        max_inflight_tokens: int = 1 << 20,
        client_tls: TlsConfig | None = None,  # of the channels to workers; None: plaintext
        http_port: int | None = None,  # OpenAI-compatible HTTP API on the gRPC host; None: off, 0: ephemeral
        metrics_port: int | None = None,  # Prometheus /metrics on the gRPC host; None: off, 0: ephemeral
        http_max_n: int = DEFAULT_MAX_N,  # the most choices (n) one HTTP request may ask for
        http_max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        disaggregation: str = "auto",  # always | never | auto: where prompts are prefilled (pdserve/gateway/disaggregation.py)
        max_tpot_increase: float = 0.1,  # auto: local prefills' stall budget on a decode worker's streams
        kv_push: bool = True,  # push KV to the decode worker while the prefill runs (grpc, shm); False: pull
        tool_call_parser: str | None = None,  # HTTP chat: tool_choice "auto" parses calls in this format; None: off
        reasoning_parser: str | None = None,  # HTTP chat: the thinking apart, in reasoning_content; None: off
        lora_adapters: LoRAAdapters | None = None,  # the LoRA adapters requests may name; None: no LoRA
        migration: MigrationPolicy = MigrationPolicy(),  # how a stream whose decode worker fails moves on
    ) -> None:
        self.http_port, self.http_max_n, self.http_max_body_bytes = http_port, http_max_n, http_max_body_bytes
        # Built here so that an unknown parser name fails the gateway before anything listens.
        self.tool_parser = tool_parser(tool_call_parser) if tool_call_parser is not None else None
        self.reasoning_parser = build_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None
        self.http_api: OpenAIHttpApi | None = None
        # The HTTP port serves TLS exactly when the gRPC port does, with its certificate and client CA;
        # built here so that a bad file fails the gateway before anything listens.
        self.http_ssl_context = (
            server_ssl_context(server_config.tls) if http_port is not None and server_config.tls is not None else None
        )
        self._redis = connect(redis_url) if redis_url else None
        registry = WorkerRegistry(self._redis, redis_prefix) if self._redis is not None else None
        lookup = PrefixIndexLookup(self._redis, redis_prefix) if self._redis is not None else None
        self.pool = WorkerPool(list(prefill_addresses), list(decode_addresses), registry, poll_s=poll_s, tls=client_tls)
        self.router = Router(self.pool, lookup, routing)
        self.servicer = GenerationServicer(
            self.router,
            tokenizer,
            transport,
            RequestLimits(max_logprobs=max_logprobs),
            Admission(max_inflight_requests, max_inflight_tokens),
            disaggregation=DisaggregationPolicy(disaggregation, max_tpot_increase=max_tpot_increase),
            kv_push=kv_push,
            lora_adapters=lora_adapters,
            migration=migration,
        )
        self.metrics_endpoint = (
            MetricsEndpoint(self.servicer.metrics.registry, server_config.host, metrics_port)
            if metrics_port is not None else None
        )
        self.server = Server(server_config, [SERVICE_NAME])
        self.server.add_servicer(generation_pb2_grpc.add_GenerationServicer_to_server, self.servicer)

    async def start(self) -> int:
        await self.pool.start()
        port = await self.server.start()
        log.info("gateway serving on %s:%d", self.server.config.host, port)
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.start()
        if self.http_port is not None:
            config = self.server.config
            self.http_api = OpenAIHttpApi(self.servicer, config.host, self.http_port, None, self.servicer.tokenizer,
                                          auth_token=config.auth_token, grace_s=config.grace_s,
                                          max_n=self.http_max_n, max_body_bytes=self.http_max_body_bytes,
                                          ssl_context=self.http_ssl_context, tool_parser=self.tool_parser,
                                          reasoning_parser=self.reasoning_parser)
            self.http_port = await self.http_api.start()
        return port

    async def stop(self) -> None:
        if self.http_api is not None:
            await self.http_api.stop()
        await self.server.stop()
        await self.pool.stop()
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.stop()
        if self._redis is not None:
            await self._redis.aclose()
