"""OpenAI's JSON request and response shapes, translated to and from pdserve's GenerateRequest/Response.

Pure functions: no I/O, so the translation is testable without a server.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protos.pdserve.v1 import generation_pb2

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


class InvalidRequest(ValueError):
    """A request body OpenAI's API would refuse; answered 400 with ``param`` naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ParsedRequest:
    """What the HTTP layer needs from a completions or chat body."""

    generate: generation_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: bool  # whether to return them at all (chat's logprobs may be true with top_logprobs 0)


def parse_completion(body: Mapping[str, Any]) -> ParsedRequest:
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (one prompt only)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    request = generation_pb2.GenerateRequest()
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise InvalidRequest("prompt token ids must be >= 0", "prompt")
        request.prompt_token_ids.extend(prompt)
    else:
        raise InvalidRequest("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    logprobs = _optional(body, "logprobs", int)
    _sampling_params(body, request.sampling_params, body.get("max_tokens"), logprobs)
    return ParsedRequest(request, *_stream_flags(body), logprobs is not None)


def parse_chat(body: Mapping[str, Any], tokenizer: Any) -> ParsedRequest:
    """``POST /v1/chat/completions``: the messages through the tokenizer's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise InvalidRequest("messages must be a non-empty list of message objects", "messages")
    if tokenizer is None:
        raise InvalidRequest("chat needs the model's tokenizer, and this gateway has none; use /v1/completions "
                             "with token ids", "messages")
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as error:  # noqa: BLE001 - a template's own error, reported to the caller
        raise InvalidRequest(f"messages do not fit the model's chat template: {error}", "messages") from error
    token_ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    request = generation_pb2.GenerateRequest(prompt_token_ids=list(token_ids))
    wants_logprobs = bool(_optional(body, "logprobs", bool))
    top_logprobs = _optional(body, "top_logprobs", int)
    if top_logprobs is not None and not wants_logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    _sampling_params(body, request.sampling_params, max_tokens, (top_logprobs or 0) if wants_logprobs else None)
    return ParsedRequest(request, *_stream_flags(body), wants_logprobs)


def _sampling_params(
    body: Mapping[str, Any], params: generation_pb2.SamplingParams, max_tokens: Any, logprobs: int | None
) -> None:
    """Type checks only; ranges are the gateway's validation's, so both APIs refuse the same values."""
    n = _optional(body, "n", int)
    if n not in (None, 1):
        raise InvalidRequest(f"n must be 1: this server returns one choice per request, got {n}", "n")
    if max_tokens is not None:
        params.max_tokens = _typed("max_tokens", max_tokens, int)
    for name in ("temperature", "top_p"):
        value = _optional(body, name, float)
        if value is not None:
            setattr(params, name, value)
    seed = _optional(body, "seed", int)
    if seed is not None:
        params.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        params.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        params.stop.extend(stop)
    elif stop is not None:
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    if logprobs is not None:
        params.logprobs = logprobs
    params.ignore_eos = bool(_optional(body, "ignore_eos", bool))  # vLLM's extension


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(_optional(body, "stream", bool))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", "stream_options")
    if options and not stream:
        raise InvalidRequest("stream_options is only allowed with stream: true", "stream_options")
    return stream, bool(options.get("include_usage", False))


def _optional(body: Mapping[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    return None if value is None else _typed(name, value, kind)


def _typed(name: str, value: Any, kind: type) -> Any:
    # bool is an int in Python, and JSON's true is not a token count.
    ok = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise InvalidRequest(f"{name} must be {'a boolean' if kind is bool else 'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}", name)
    return value


def usage_json(usage: generation_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def finish_reason(response: generation_pb2.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(response.finish_reason)


class Decoder:
    """Token ids as text for logprobs; ``token_id:<id>`` (vLLM's form) without a tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def completion_logprobs(pieces: list[generation_pb2.TokenLogprobs], decoder: Decoder, offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists; ``offset`` is where this text starts in the completion."""
    tokens = [decoder.token(p.token_id) for p in pieces]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [p.logprob for p in pieces],
        "top_logprobs": [{decoder.token(t): lp for t, lp in zip(p.top_token_ids, p.top_logprobs)} for p in pieces],
        "text_offset": offsets,
    }


def chat_logprobs(pieces: list[generation_pb2.TokenLogprobs], decoder: Decoder) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = decoder.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(p.token_id, p.logprob),
             "top_logprobs": [entry(t, lp) for t, lp in zip(p.top_token_ids, p.top_logprobs)]}
            for p in pieces
        ]
    }


def now() -> int:
    return int(time.time())
