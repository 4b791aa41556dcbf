"""OpenAI-compatible HTTP API on the gateway, served by aiohttp in the gateway's own event loop.

Requests run through the gateway's ``GenerationServicer`` in-process rather than
over a loopback gRPC channel: the same validation, admission and routing, with
no second hop, and no client certificate needed when the gRPC port requires mTLS.
gRPC status codes become HTTP statuses in one place, ``_STATUS``. A request
for n choices is n calls of the servicer (``_Choices``): choice 0 first, the
others once it has answered, so they find its prompt in the prefix cache.
The port speaks HTTPS when the gateway's gRPC port speaks TLS (same certificate).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from aiohttp import web

from pdserve.gateway.openai_protocol import DEFAULT_MAX_N, InvalidRequest, ParsedRequest, parse_chat, parse_completion
from pdserve.gateway.openai_responses import ChatFormat, CompletionFormat, Decoder, ResponseFormat, now
from pdserve.gateway.reasoning_parsers import ReasoningParser
from pdserve.gateway.tool_parsers import ToolParser
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.service_common.errors import Unavailable

log = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_FIELD_NAMES = {"prompt_token_ids": "prompt"}  # GenerateRequest field -> OpenAI field, where they differ
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt as JSON token ids is about 1 MiB


class RpcAbort(Exception):
    """A servicer's ``context.abort``, caught by the HTTP handler instead of the gRPC runtime."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _LocalContext:
    """The part of ``grpc.aio.ServicerContext`` that ``GenerationServicer`` uses, for in-process calls."""

    def __init__(self, timeout_s: float | None) -> None:
        self._deadline = time.monotonic() + timeout_s if timeout_s is not None else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise RpcAbort(code, details)


class OpenAIHttpApi:
    """``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and ``/health`` over one servicer; with LoRA
    adapters the ``model`` field selects one (``/v1/models`` lists them), and with runtime updating allowed,
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's) add and remove them."""

    def __init__(
        self,
        servicer: Any,  # gateway.server.GenerationServicer
        host: str,
        port: int,
        model_name: str | None,  # None: the model id the workers report
        tokenizer: Any,
        *,
        auth_token: str | None = None,  # None: no authentication
        grace_s: float = 5.0,
        request_timeout_s: float | None = None,  # None: no deadline, as with a gRPC call without one
        max_n: int = DEFAULT_MAX_N,  # the most choices one request may ask for
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,  # larger bodies are answered 413 unread
        ssl_context: ssl.SSLContext | None = None,  # HTTPS with it; None: plain HTTP
        tool_parser: ToolParser | None = None,  # chat's tool_choice "auto" finds calls with it; None: refused
        reasoning_parser: ReasoningParser | None = None,  # chat: the thinking as reasoning_content; None: off
    ) -> None:
        if max_n < 1 or max_body_bytes < 1:
            raise ValueError("max_n and max_body_bytes must be >= 1")
        self.servicer, self.host, self.port = servicer, host, port
        self.model_name, self.tokenizer = model_name, tokenizer
        self.auth_token, self.grace_s, self.request_timeout_s = auth_token, grace_s, request_timeout_s
        self.max_n, self.max_body_bytes = max_n, max_body_bytes
        self.ssl_context = ssl_context
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.draining = False
        self._decoder = Decoder(tokenizer)
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application(middlewares=[self._errors, self._authenticate], client_max_size=self.max_body_bytes)
        app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
        ])
        if self.servicer.lora_adapters.allow_runtime_updating:
            app.add_routes([
                web.post("/v1/load_lora_adapter", self._load_lora_adapter),
                web.post("/v1/unload_lora_adapter", self._unload_lora_adapter),
            ])
        # handler_cancellation: a client that disconnects cancels its handler, and so its generation.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=self.grace_s, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr] - the bound port when 0
        scheme = "https" if self.ssl_context is not None else "http"
        log.info("OpenAI HTTP API on %s://%s:%d/v1", scheme, self.host, self.port)
        return self.port

    async def stop(self) -> None:
        """/health answers 503 at once; running requests get ``grace_s`` to finish."""
        self.draining = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- middlewares ---

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        try:
            return await handler(request)
        except InvalidRequest as error:
            return error_response(400, str(error), "invalid_request_error", error.param)
        except ModelNotFound as error:
            return error_response(404, str(error), "invalid_request_error", "model", code="model_not_found")
        except RpcAbort as error:
            return self._rpc_error_response(error, request.path)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            message = error.reason
            if error.status == 413:
                message = (f"the request body exceeds this server's limit of {self.max_body_bytes} bytes "
                           "(--http-max-body-bytes)")
            kind = "invalid_request_error" if error.status < 500 else "server_error"
            return error_response(error.status, message, kind)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        # /health stays open, as gRPC health does behind BearerTokenInterceptor.
        if self.auth_token is None or request.path == "/health":
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.auth_token.encode()):
            return error_response(401, "missing or wrong API key: send Authorization: Bearer <token>",
                                  "authentication_error", code="invalid_api_key")
        return await handler(request)

    # --- routes ---

    async def _health(self, request: web.Request) -> web.Response:
        pool = self.servicer.router.pool
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not pool.healthy("prefill") or not pool.healthy("decode"):
            return web.json_response({"status": "no workers"}, status=503)
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        base = self._model_name()
        created = now()
        report = self._report()
        model: dict[str, Any] = {"id": base, "object": "model", "created": created, "owned_by": "pdserve",
                                 "root": report.model_id if report is not None else base, "parent": None}
        if report is not None:
            # vLLM lists max_model_len; vocab_size is pdserve's (what `pdserve bench --backend http` draws ids from).
            model.update(max_model_len=report.max_model_len, vocab_size=report.vocab_size)
        # vLLM's shape: each adapter with its folder as root and the model it adapts as parent.
        adapters = [{"id": adapter.name, "object": "model", "created": created, "owned_by": "pdserve",
                     "root": adapter.path, "parent": adapter.base_model_name or base}
                    for adapter in self.servicer.lora_adapters]
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        name, path = _adapter_fields(body, ("lora_name", "lora_path"))
        try:
            await self.servicer.load_lora_adapter(name, path)
        except ValueError as error:  # taken name, or an adapter the workers cannot serve: the message names it
            return error_response(400, str(error), "invalid_request_error", "lora_name")
        except Unavailable as error:
            return error_response(503, str(error), "service_unavailable")
        log.info("LoRA adapter %r loaded from %s", name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        (name,) = _adapter_fields(body, ("lora_name",), optional=("lora_int_id",))
        try:
            await self.servicer.unload_lora_adapter(name)
        except KeyError as error:
            return error_response(404, error.args[0], "not_found_error", "lora_name")
        except Unavailable as error:
            return error_response(503, str(error), "service_unavailable")
        log.info("LoRA adapter %r unloaded", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _lora_name(self, body: dict[str, Any]) -> str:
        """The LoRA adapter the ``model`` field selects ("": the base model). Without LoRA, any name is the base
        model; with it, the base answers to its id and to "pdserve", and any other name that is not an adapter
        is ``ModelNotFound`` (404 model_not_found)."""
        model = body.get("model")
        adapters = self.servicer.lora_adapters
        if not adapters.enabled or not isinstance(model, str):
            return ""  # a model that is not a string is refused by the parser, naming it
        if model in adapters:
            return model
        report = self._report()
        if model in (self._model_name(), "pdserve", report.model_id if report is not None else None):
            return ""
        raise ModelNotFound(f"The model `{model}` does not exist.")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        parsed = parse_completion(body, self.max_n)
        parsed.generate.lora_name = self._lora_name(body)
        generate = parsed.generate
        prompt_text = generate.prompt
        if generate.prompt and self.tokenizer is not None:
            # Tokenized once here rather than once per choice; echo needs the ids too.
            token_ids = self.servicer.prompt_token_ids(generate)
            if token_ids:
                generate.prompt_token_ids.extend(token_ids)
                generate.ClearField("prompt")
        if parsed.echo:
            if self.tokenizer is None:
                raise InvalidRequest("echo needs the model's tokenizer to give the prompt as text, and this gateway "
                                     "has none", "echo")
            prompt_text = prompt_text or self.tokenizer.decode(list(generate.prompt_token_ids))
        form = CompletionFormat(generate.lora_name or self._model_name(), self._decoder, parsed, prompt_text)
        return await self._generate(request, parsed, form)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        parsed = parse_chat(body, self.tokenizer, self.max_n, self.tool_parser is not None, self.reasoning_parser)
        if self.tool_parser is not None:
            parsed = self.tool_parser.adjust_request(parsed)
        parsed.generate.lora_name = self._lora_name(body)
        form = ChatFormat(parsed.generate.lora_name or self._model_name(), self._decoder, parsed, self.tool_parser,
                          self.reasoning_parser)
        return await self._generate(request, parsed, form)

    # --- generation ---

    async def _generate(self, request: web.Request, parsed: ParsedRequest, form: ResponseFormat) -> web.StreamResponse:
        choices = _Choices(self.servicer, parsed.choice_requests(), self.request_timeout_s)
        # However the handler ends (client gone, error), every choice's servicer
        # call is closed at once: decode calls cancelled, leases released.
        try:
            # Every choice's first response comes before any byte is sent, so an
            # error up to here (validation, admission, no worker) gets its HTTP status.
            firsts = await choices.start()
            if not parsed.stream:
                responses = firsts + [item async for item in choices]
                return web.json_response(form.whole(responses))
            sse = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await sse.prepare(request)
            try:
                for index, response in firsts:
                    await _send_all(sse, form.chunks(index, response))
                async for index, response in choices:
                    await _send_all(sse, form.chunks(index, response))
            except RpcAbort as error:
                # Headers are gone: the error travels as an event, as OpenAI's own servers do.
                status, kind = _STATUS.get(error.code, (500, "server_error"))
                await _send(sse, {"error": _error_body(error.details, kind, None, status)})
            else:
                if parsed.include_usage:
                    await _send(sse, form.usage_chunk())
            await sse.write(b"data: [DONE]\n\n")
            await sse.write_eof()
            return sse
        finally:
            await choices.close()

    def _model_name(self) -> str:
        if self.model_name:
            return self.model_name
        report = self._report()
        return report.model_id if report is not None else "pdserve"

    def _report(self) -> Any:
        """A healthy worker's latest load report (model id, vocabulary, context), or None."""
        pool = self.servicer.router.pool
        return next((w.report for w in pool.healthy("prefill") + pool.healthy("decode") if w.report), None)

    def _rpc_error_response(self, error: RpcAbort, path: str) -> web.Response:
        status, kind = _STATUS.get(error.code, (500, "server_error"))
        message = error.details.replace("sampling_params.", "")
        param = None
        if status == 400:
            field = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
            field = _FIELD_NAMES.get(field, field)
            if path.endswith("/chat/completions") and field in ("prompt", "logprobs"):
                field = "messages" if field == "prompt" else "top_logprobs"
            param = field if field.isidentifier() else None
        return error_response(status, message, kind, param)


class _Choices:
    """A request's n choices, each a call of the servicer, as one stream of ``(index, response)``.

    Choice 0 runs alone until its first response (its prompt is then in the
    prefix cache); the others start then.
    """

    def __init__(self, servicer: Any, requests: list[generation_pb2.GenerateRequest], timeout_s: float | None) -> None:
        self._servicer, self._requests = servicer, requests
        self._context = _LocalContext(timeout_s)  # one deadline for all choices
        # Items: a response, the exception that ended a choice, or None when a choice is done.
        self._queue: asyncio.Queue[tuple[int, generation_pb2.GenerateResponse | Exception | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0

    async def start(self) -> list[tuple[int, generation_pb2.GenerateResponse]]:
        """Every choice up to its first response (those responses, in arrival order); raises the first error."""
        self._start(0)
        firsts = [await self._next_response()]
        for index in range(1, len(self._requests)):
            self._start(index)
        started = {0}
        while len(started) < len(self._requests):
            index, response = await self._next_response()
            started.add(index)
            firsts.append((index, response))
        return firsts

    def __aiter__(self) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
        return self._rest()

    async def _rest(self) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
        while self._running:
            index, item = await self._next()
            if item is not None:
                yield index, item

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _start(self, index: int) -> None:
        self._running += 1
        self._tasks.append(asyncio.get_running_loop().create_task(self._pump(index)))

    async def _pump(self, index: int) -> None:
        stream = self._servicer.Generate(self._requests[index], self._context)
        try:
            async with contextlib.aclosing(stream):
                async for response in stream:
                    self._queue.put_nowait((index, response))
        except Exception as error:  # noqa: BLE001 - raised in the handler, which answers it
            self._queue.put_nowait((index, error))
        else:
            self._queue.put_nowait((index, None))

    async def _next(self) -> tuple[int, generation_pb2.GenerateResponse | None]:
        index, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        if item is None:
            self._running -= 1
        return index, item

    async def _next_response(self) -> tuple[int, generation_pb2.GenerateResponse]:
        while True:
            index, item = await self._next()
            if item is not None:
                return index, item


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.text())  # over client_max_size: 413, before any of it is parsed
    except RecursionError as error:
        raise InvalidRequest("the request body is nested too deeply") from error
    except ValueError as error:  # not JSON, or an integer of more digits than Python converts
        raise InvalidRequest(f"the request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


async def _send_all(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    for event in events:
        await _send(response, event)


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(event)}\n\n".encode())


class ModelNotFound(LookupError):
    """The ``model`` field names neither the served model nor one of its LoRA adapters."""


def _adapter_fields(body: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> list[str]:
    """The named string fields of a load/unload body, each non-empty; ``InvalidRequest`` naming the field."""
    unknown = sorted(set(body) - set(required) - set(optional))
    if unknown:
        raise InvalidRequest(f"unknown parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}", unknown[0])
    values = []
    for name in required:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{name} must be a non-empty string", name)
        values.append(value)
    return values


def _error_body(message: str, kind: str, param: str | None, status: int, code: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": param, "code": code if code is not None else status}


def error_response(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> web.Response:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return web.json_response({"error": _error_body(message, kind, param, status, code)}, status=status)

