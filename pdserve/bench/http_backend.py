"""The benchmark's backend for the gateway's OpenAI-compatible HTTP API (``/v1/completions``, streamed).

Each request is one streamed completion with ``stream_options`` asking for
usage on every chunk (vLLM's ``continuous_usage_stats``): the running
``completion_tokens`` says how many tokens each chunk carried, so ITL and TPOT
are measured exactly as over gRPC. The final usage chunk gives the counts.
The OpenAI API carries no speculative-decoding counts: acceptance is reported
by the gRPC backend and the workers' Prometheus metrics.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from pdserve.bench.backend import BackendError, BackendRequest, ModelDescription, StreamChunk, Usage
from pdserve_client.channels import TlsConfig

MODEL_INFO_TIMEOUT_S = 10.0


class HttpBackend:
    """Streams requests to ``http(s)://target/v1/completions`` over one connection pool.

    Construct it inside the event loop that will use it (an aiohttp session belongs to its loop).
    """

    def __init__(
        self,
        target: str,
        clock: Callable[[], float] = time.perf_counter,
        tls: TlsConfig | None = None,
        auth_token: str | None = None,
    ) -> None:
        self.base_url = f"{'https' if tls is not None else 'http'}://{target}"
        self._clock = clock
        self._ssl = _ssl_context(tls) if tls is not None else None
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        # No pool limit: --max-concurrency is the benchmark's, not the client library's.
        self._session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl))
        self._model_id = ""

    async def model_info(self) -> ModelDescription:
        try:
            async with self._session.get(
                f"{self.base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=MODEL_INFO_TIMEOUT_S)
            ) as response:
                body = await _json_or_error(response)
        except aiohttp.ClientError as error:
            raise BackendError("CONNECTION", str(error)) from error
        models = body.get("data") or []
        if not models:
            raise BackendError("NO_MODEL", f"{self.base_url}/v1/models lists no model")
        model = models[0]
        self._model_id = str(model.get("id", ""))
        return ModelDescription(
            model_id=self._model_id,
            # pdserve's gateway lists both (vLLM lists max_model_len); 0 where a server does not say.
            vocab_size=int(model.get("vocab_size") or 0),
            max_context_length=int(model.get("max_model_len") or 0),
        )

    async def stream(self, request: BackendRequest) -> AsyncIterator[StreamChunk]:
        body = to_json(request, self._model_id)
        completion_tokens = 0
        try:
            async with self._session.post(
                f"{self.base_url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=request.timeout_s),
                headers={"X-Request-Id": request.request_id},
            ) as response:
                if response.status != 200:
                    await _json_or_error(response)
                async for line in response.content:
                    timestamp = self._clock()
                    text = line.decode("utf-8").strip()
                    if not text.startswith("data:"):
                        continue  # blank separators, comments
                    data = text[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        raise BackendError(str(error.get("code") or error.get("type")), str(error.get("message")))
                    usage = event.get("usage")
                    if not event.get("choices"):
                        if usage is not None:  # the final usage chunk
                            yield StreamChunk(timestamp=timestamp, num_tokens=0, usage=_usage(usage))
                        continue
                    running = int(usage["completion_tokens"]) if usage else completion_tokens
                    yield StreamChunk(timestamp=timestamp, num_tokens=running - completion_tokens)
                    completion_tokens = running
        except aiohttp.ClientError as error:
            raise BackendError("CONNECTION", f"{type(error).__name__}: {error}") from error
        except TimeoutError as error:
            raise BackendError("DEADLINE_EXCEEDED", f"no answer within {request.timeout_s} s") from error

    async def close(self) -> None:
        await self._session.close()


def to_json(request: BackendRequest, model_id: str) -> dict[str, Any]:
    """The ``/v1/completions`` body of one benchmark request, streamed with usage on every chunk."""
    body: dict[str, Any] = {
        "prompt": list(request.prompt_token_ids) if request.prompt_token_ids is not None else (request.prompt or ""),
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "ignore_eos": request.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if model_id:
        body["model"] = model_id
    if request.seed is not None:
        body["seed"] = request.seed
    return body


def _usage(usage: dict[str, Any]) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_prompt_tokens=int(details.get("cached_tokens", 0)),
    )


async def _json_or_error(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """The JSON body of a 200 answer; anything else raises ``BackendError`` with the status and the message."""
    text = await response.text()
    if response.status != 200:
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text[:200]
        raise BackendError(str(response.status), message)
    return json.loads(text)


def _ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=tls.ca_file)
    if tls.cert_file is not None:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context
