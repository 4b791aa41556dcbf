"""Clients of pdserve's public API (``pdserve.v1.Generation``): ``AsyncClient`` and the blocking ``Client``.

Both speak typed values (``SamplingOptions`` in, ``Completion``/``StreamChunk``
out) and raise ``PdserveError`` carrying the gRPC status code, so callers never
touch protobuf or grpc exceptions. Leaving a stream early cancels the call,
which aborts the request on every worker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from pdserve_client.channels import (
    DEFAULT_MAX_MESSAGE_BYTES,
    TlsConfig,
    bearer_metadata,
    channel_options,
    open_blocking_channel,
    open_channel,
)
from pdserve_client.v1 import generation_pb2, generation_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"

_FINISH_REASONS: dict[int, str | None] = {
    generation_pb2.FINISH_REASON_UNSPECIFIED: None,
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


# ---- typed values ---------------------------------------------------------------


@dataclass(frozen=True)
class SamplingOptions:
    """How to sample and when to stop; None (or empty) leaves a field at the server's default.

    The server validates them and answers INVALID_ARGUMENT naming the field.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> bias added to its logit
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs, with this many alternatives each
    skip_special_tokens: bool | None = None  # False: the text writes the tokenizer's special tokens
    use_speculation: bool | None = None  # False: this request decodes one token per step on a speculating server
    # The output held to a JSON schema, a regex, choices or a grammar: ``generation_pb2.StructuredOutput(choice=
    # generation_pb2.Choices(choices=["yes", "no"]))``, as docs/api.md describes the message.
    structured_outputs: generation_pb2.StructuredOutput | None = None

    def to_proto(self) -> generation_pb2.SamplingParams:
        """The message with only the given optional fields set, so unset ones keep proto3 presence 'absent'."""
        message = generation_pb2.SamplingParams(
            stop=list(self.stop), stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            logit_bias=dict(self.logit_bias),
        )
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "min_tokens",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_logprobs",
                     "skip_special_tokens", "use_speculation"):
            value = getattr(self, name)
            if value is not None:
                setattr(message, name, value)
        if self.structured_outputs is not None:
            message.structured_outputs.CopyFrom(self.structured_outputs)
        return message


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    # (token_id, logprob) pairs, most likely first.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class StreamChunk:
    """A piece of a streamed completion; ``finish_reason`` and ``usage`` are set on the last one only."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None  # "stop", "length", "abort"; None until the last chunk
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] = ()
    # On the first chunk, when prompt_logprobs was asked: one per prompt token from the second on.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A whole completion: every chunk of the stream folded together."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """What the cluster serves."""

    model_id: str
    max_context_length: int
    block_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = field(default=())


class PdserveError(Exception):
    """A failed call: the gRPC status code and the server's (or the channel's) message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


# ---- conversions (the one place protobuf and grpc errors are handled) ------------------


def _request(
    prompt: str | Sequence[int], options: SamplingOptions | None, request_id: str | None, lora_name: str | None = None
) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(request_id=request_id or "", lora_name=lora_name or "")
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    request.sampling_params.CopyFrom((options or SamplingOptions()).to_proto())
    return request


def _chunk(response: generation_pb2.GenerateResponse) -> StreamChunk:
    usage = None
    if response.HasField("usage"):
        usage = Usage(
            prompt_tokens=response.usage.prompt_tokens,
            completion_tokens=response.usage.completion_tokens,
            cached_prompt_tokens=response.usage.cached_prompt_tokens,
        )
    return StreamChunk(
        request_id=response.request_id,
        token_ids=tuple(response.token_ids),
        text=response.text,
        finish_reason=_FINISH_REASONS.get(response.finish_reason),
        usage=usage,
        logprobs=_token_logprobs(response.logprobs),
        prompt_logprobs=_token_logprobs(response.prompt_logprobs),
    )


def _token_logprobs(entries: Iterable[generation_pb2.TokenLogprobs]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(entry.token_id, entry.logprob, tuple(zip(entry.top_token_ids, entry.top_logprobs)))
        for entry in entries
    )


def _model_info(response: generation_pb2.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_id=response.model_id,
        max_context_length=response.max_context_length,
        block_size=response.block_size,
        vocab_size=response.vocab_size,
        eos_token_ids=tuple(response.eos_token_ids),
    )


def _fold(chunks: Iterable[StreamChunk]) -> Completion:
    """One completion from a finished stream's chunks (which must end with usage)."""
    chunks = list(chunks)
    last = chunks[-1] if chunks else None
    if last is None or last.usage is None:
        raise PdserveError(grpc.StatusCode.INTERNAL, "the server ended the stream without a final response")
    return Completion(
        request_id=last.request_id,
        token_ids=tuple(token for chunk in chunks for token in chunk.token_ids),
        text="".join(chunk.text for chunk in chunks),
        finish_reason=last.finish_reason,
        usage=last.usage,
        logprobs=tuple(entry for chunk in chunks for entry in chunk.logprobs),
        prompt_logprobs=chunks[0].prompt_logprobs,
    )


def _error(error: grpc.RpcError) -> PdserveError:
    # Both grpc.aio.AioRpcError and the blocking API's errors are also grpc.Call objects.
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return PdserveError(code, details or "")


# ---- asyncio client ----------------------------------------------------------------


class AsyncClient:
    """pdserve's public API on a grpc.aio channel; one channel multiplexes every call.

    Construct it inside the event loop that will use it: a grpc.aio channel
    belongs to the loop it was created on. ``timeout`` is the default deadline
    of every call in seconds (None: no deadline); each call may override it.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        tls: TlsConfig | None = None,
        auth_token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout: float | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = open_channel(target, tls, channel_options(max_message_bytes))
        self._metadata = bearer_metadata(auth_token)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def generate(
        self,
        prompt: str | Sequence[int],
        options: SamplingOptions | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        lora_name: str | None = None,
    ) -> Completion:
        return _fold([chunk async for chunk in self.stream(prompt, options, request_id=request_id, timeout=timeout,
                                                           lora_name=lora_name)])

    async def stream(
        self,
        prompt: str | Sequence[int],
        options: SamplingOptions | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[StreamChunk]:
        call = self._stub.Generate(
            _request(prompt, options, request_id, lora_name), timeout=self._deadline(timeout),
            metadata=self._metadata,
        )
        try:
            async for response in call:
                yield _chunk(response)
        except grpc.aio.AioRpcError as error:
            raise _error(error) from error
        finally:
            # A no-op once the stream has ended; when the caller broke out of the loop
            # (the generator is closed) or its task was cancelled, it aborts the request.
            call.cancel()

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        try:
            response = await self._stub.ModelInfo(
                generation_pb2.ModelInfoRequest(), timeout=self._deadline(timeout), metadata=self._metadata
            )
        except grpc.aio.AioRpcError as error:
            raise _error(error) from error
        return _model_info(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout


# ---- blocking client ---------------------------------------------------------------


class Client:
    """pdserve's public API on a blocking grpc channel; safe to share between threads.

    The same methods as ``AsyncClient``; ``stream`` is a plain iterator, and
    leaving it early (``break``, or closing it) cancels the call.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        tls: TlsConfig | None = None,
        auth_token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout: float | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = open_blocking_channel(target, tls, channel_options(max_message_bytes))
        self._metadata = bearer_metadata(auth_token)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        options: SamplingOptions | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        lora_name: str | None = None,
    ) -> Completion:
        return _fold(self.stream(prompt, options, request_id=request_id, timeout=timeout, lora_name=lora_name))

    def stream(
        self,
        prompt: str | Sequence[int],
        options: SamplingOptions | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        lora_name: str | None = None,
    ) -> Iterator[StreamChunk]:
        call = self._stub.Generate(
            _request(prompt, options, request_id, lora_name), timeout=self._deadline(timeout),
            metadata=self._metadata,
        )
        try:
            for response in call:
                yield _chunk(response)
        except grpc.RpcError as error:
            raise _error(error) from error
        finally:
            call.cancel()  # a no-op once the stream has ended; aborts it when the caller left early

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        try:
            response = self._stub.ModelInfo(
                generation_pb2.ModelInfoRequest(), timeout=self._deadline(timeout), metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise _error(error) from error
        return _model_info(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout
