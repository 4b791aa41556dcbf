"""OpenAI-compatible HTTP API on the gateway, served by aiohttp in the gateway's own event loop.

Requests run through the gateway's ``GenerationServicer`` in-process rather than
over a loopback gRPC channel: the same validation, admission and routing, with
no second hop, and no client certificate needed when the gRPC port requires mTLS.
gRPC status codes become HTTP statuses in one place, ``_STATUS``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from aiohttp import web

from gateway.openai_protocol import (
    Decoder,
    InvalidRequest,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    now,
    parse_chat,
    parse_completion,
    usage_json,
)
from protos.pdserve.v1 import generation_pb2

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
    """``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and ``/health`` over one servicer."""

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
    ) -> None:
        self.servicer, self.host, self.port = servicer, host, port
        self.model_name, self.tokenizer = model_name, tokenizer
        self.auth_token, self.grace_s, self.request_timeout_s = auth_token, grace_s, request_timeout_s
        self.draining = False
        self._decoder = Decoder(tokenizer)
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application(middlewares=[self._errors, self._authenticate])
        app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
        ])
        # handler_cancellation: a client that disconnects cancels its handler, and so its generation.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=self.grace_s, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr] - the bound port when 0
        log.info("OpenAI HTTP API on http://%s:%d/v1", self.host, self.port)
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
        except RpcAbort as error:
            return self._rpc_error_response(error, request.path)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return error_response(error.status, error.reason, "invalid_request_error" if error.status < 500 else "server_error")

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
        model = {"id": self._model_name(), "object": "model", "created": now(), "owned_by": "pdserve"}
        return web.json_response({"object": "list", "data": [model]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_completion(await _json_body(request))
        return await self._generate(request, parsed, _CompletionFormat(self._model_name(), self._decoder, parsed))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_chat(await _json_body(request), self.tokenizer)
        return await self._generate(request, parsed, _ChatFormat(self._model_name(), self._decoder, parsed))

    # --- generation ---

    async def _generate(self, request: web.Request, parsed: ParsedRequest, form: _Format) -> web.StreamResponse:
        stream = self.servicer.Generate(parsed.generate, _LocalContext(self.request_timeout_s))
        # aclosing: however the handler ends (client gone, error), the servicer's
        # cleanup runs at once: the decode call is cancelled and the lease released.
        async with contextlib.aclosing(stream):
            # The first response comes before any byte is sent, so an error up
            # to here (validation, admission, no worker) gets its HTTP status.
            first = await anext(stream)
            if not parsed.stream:
                responses = [first] + [response async for response in stream]
                return web.json_response(form.whole(responses))
            sse = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await sse.prepare(request)
            last = first
            try:
                for chunk in form.opening():
                    await _send(sse, chunk)
                await _send(sse, form.chunk(first))
                async for last in stream:
                    await _send(sse, form.chunk(last))
            except RpcAbort as error:
                # Headers are gone: the error travels as an event, as OpenAI's own servers do.
                status, kind = _STATUS.get(error.code, (500, "server_error"))
                await _send(sse, {"error": _error_body(error.details, kind, None, status)})
            else:
                if parsed.include_usage:
                    await _send(sse, form.usage_chunk(last.usage))
            await sse.write(b"data: [DONE]\n\n")
            await sse.write_eof()
            return sse

    def _model_name(self) -> str:
        if self.model_name:
            return self.model_name
        pool = self.servicer.router.pool
        report = next((w.report for w in pool.healthy("prefill") + pool.healthy("decode") if w.report), None)
        return report.model_id if report is not None else "pdserve"

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


class _Format:
    """One endpoint's response objects, built from GenerateResponses."""

    prefix = ""  # of the response id
    object_name = ""
    chunk_object_name = ""

    def __init__(self, model: str, decoder: Decoder, parsed: ParsedRequest) -> None:
        self.model, self.decoder, self.parsed = model, decoder, parsed
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = now()
        self.text_length = 0  # characters of completion text so far, for logprobs' text_offset

    def head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def usage_chunk(self, usage: generation_pb2.Usage) -> dict[str, Any]:
        return {**self.head(self.chunk_object_name), "choices": [], "usage": usage_json(usage)}

    def whole(self, responses: list[generation_pb2.GenerateResponse]) -> dict[str, Any]:
        merged = generation_pb2.GenerateResponse(text="".join(r.text for r in responses))
        for response in responses:
            merged.token_ids.extend(response.token_ids)
            merged.logprobs.extend(response.logprobs)
        merged.finish_reason = responses[-1].finish_reason
        return {**self.head(self.object_name), "choices": [self.choice(merged)], "usage": usage_json(responses[-1].usage)}

    def chunk(self, response: generation_pb2.GenerateResponse) -> dict[str, Any]:
        return {**self.head(self.chunk_object_name), "choices": [self.choice(response, delta=True)]}

    def choice(self, response: generation_pb2.GenerateResponse, delta: bool = False) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionFormat(_Format):
    prefix, object_name, chunk_object_name = "cmpl", "text_completion", "text_completion"

    def choice(self, response: generation_pb2.GenerateResponse, delta: bool = False) -> dict[str, Any]:
        logprobs = None
        if self.parsed.logprobs:
            logprobs = completion_logprobs(list(response.logprobs), self.decoder, self.text_length)
        self.text_length += len(response.text)
        return {"index": 0, "text": response.text, "logprobs": logprobs, "finish_reason": finish_reason(response)}


class _ChatFormat(_Format):
    prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def opening(self) -> list[dict[str, Any]]:
        # OpenAI's first chunk names the role; the content follows.
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{**self.head(self.chunk_object_name), "choices": [first]}]

    def choice(self, response: generation_pb2.GenerateResponse, delta: bool = False) -> dict[str, Any]:
        logprobs = chat_logprobs(list(response.logprobs), self.decoder) if self.parsed.logprobs else None
        key, message = ("delta", {"content": response.text}) if delta else (
            "message", {"role": "assistant", "content": response.text})
        return {"index": 0, key: message, "logprobs": logprobs, "finish_reason": finish_reason(response)}


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"the request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(event)}\n\n".encode())


def _error_body(message: str, kind: str, param: str | None, status: int, code: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": param, "code": code if code is not None else status}


def error_response(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> web.Response:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return web.json_response({"error": _error_body(message, kind, param, status, code)}, status=status)

