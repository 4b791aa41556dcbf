"""OpenAI's JSON responses, built from pdserve's GenerateResponses.

No I/O, so the shapes are testable without a server: the HTTP layer feeds a
``ResponseFormat`` each choice's responses and sends what it returns.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pdserve.gateway.openai_protocol import ParsedRequest
from pdserve.gateway.reasoning_parsers import ReasoningParser, ReasoningStream
from pdserve.gateway.tool_parsers import ToolCall, ToolCallStream, ToolParser, new_call_id
from pdserve.protos.pdserve.v1 import generation_pb2

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


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


def completion_logprobs(
    pieces: list[generation_pb2.TokenLogprobs], decoder: Decoder, offset: int, count: int
) -> dict[str, Any]:
    """The legacy completions shape: parallel lists; ``offset`` is where this text starts in the choice's text."""
    tokens = [decoder.token(p.token_id) for p in pieces]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [p.logprob for p in pieces],
        "top_logprobs": [_top(p, decoder, count) for p in pieces],
        "text_offset": offsets,
    }


def echo_logprobs(
    first_token_id: int, prompt_logprobs: list[generation_pb2.TokenLogprobs], decoder: Decoder, count: int
) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs: the first token has no context, so null."""
    rest = completion_logprobs(prompt_logprobs, decoder, len(decoder.token(first_token_id)), count)
    return {
        "tokens": [decoder.token(first_token_id)] + rest["tokens"],
        "token_logprobs": [None] + rest["token_logprobs"],
        "top_logprobs": [None] + rest["top_logprobs"],
        "text_offset": [0] + rest["text_offset"],
    }


def _top(piece: generation_pb2.TokenLogprobs, decoder: Decoder, count: int) -> dict[str, float]:
    return {decoder.token(t): lp for t, lp in zip(piece.top_token_ids[:count], piece.top_logprobs[:count])}


def vllm_prompt_logprobs(
    prompt_logprobs: list[generation_pb2.TokenLogprobs], decoder: Decoder, count: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` field: null for the first token, then ``{token id: {logprob, rank, decoded_token}}``.

    Each position holds the prompt's own token and its ``count`` most likely
    alternatives; ``rank`` (1 = most likely) is null for the prompt's token when
    it is not among them.
    """
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for piece in prompt_logprobs:
        top_ids, top_lps = list(piece.top_token_ids[:count]), list(piece.top_logprobs[:count])
        rank = top_ids.index(piece.token_id) + 1 if piece.token_id in top_ids else None
        entry = {str(piece.token_id): {"logprob": piece.logprob, "rank": rank,
                                       "decoded_token": decoder.token(piece.token_id)}}
        for position, (token_id, logprob) in enumerate(zip(top_ids, top_lps)):
            entry.setdefault(str(token_id), {"logprob": logprob, "rank": position + 1,
                                             "decoded_token": decoder.token(token_id)})
        out.append(entry)
    return out


def chat_logprobs(pieces: list[generation_pb2.TokenLogprobs], decoder: Decoder, count: int) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = decoder.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(p.token_id, p.logprob),
             "top_logprobs": [entry(t, lp) for t, lp in zip(p.top_token_ids[:count], p.top_logprobs[:count])]}
            for p in pieces
        ]
    }


def now() -> int:
    return int(time.time())


def merged_usage(usages: list[generation_pb2.Usage]) -> generation_pb2.Usage:
    """The usage of n choices of one prompt: the prompt counted once (as choice 0 saw it), completions summed."""
    return generation_pb2.Usage(
        prompt_tokens=usages[0].prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_prompt_tokens=usages[0].cached_prompt_tokens,
    )


class ResponseFormat:
    """One endpoint's response objects, built from the GenerateResponses of a request's choices."""

    prefix = ""  # of the response id
    object_name = ""
    chunk_object_name = ""

    def __init__(self, model: str, decoder: Decoder, parsed: ParsedRequest) -> None:
        self.model, self.decoder, self.parsed = model, decoder, parsed
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = now()
        self.started = [False] * parsed.n  # whether a choice's first response was formatted
        self.prompt_logprobs: list[generation_pb2.TokenLogprobs] = []  # from choice 0's first response
        self.prompt_tokens = len(parsed.generate.prompt_token_ids)
        self.completion_tokens = 0  # streamed so far, all choices
        self.usages: dict[int, generation_pb2.Usage] = {}  # each finished choice's
        self.prompt_logprobs_sent = False

    def head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def opening(self, index: int) -> list[dict[str, Any]]:
        return []

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.head(self.chunk_object_name), "choices": [], "usage": self._usage()}

    def whole(self, responses: list[tuple[int, generation_pb2.GenerateResponse]]) -> dict[str, Any]:
        merged = [generation_pb2.GenerateResponse() for _ in range(self.parsed.n)]
        for index, response in responses:
            self._note(index, response)
            merged[index].text += response.text
            merged[index].token_ids.extend(response.token_ids)
            merged[index].logprobs.extend(response.logprobs)
            merged[index].finish_reason = response.finish_reason
        choices = [self.choice(index, response) for index, response in enumerate(merged)]
        return {**self.head(self.object_name), "choices": choices, "usage": self._usage(), **self.extra()}

    def chunks(self, index: int, response: generation_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The events one streamed response of choice ``index`` becomes."""
        opening = [] if self.started[index] else self.opening(index)
        self._note(index, response)
        events = opening + [{**self.head(self.chunk_object_name), "choices": [self.choice(index, response, delta=True)],
                             **self.extra()}]
        self.completion_tokens += len(response.token_ids)
        if self.parsed.continuous_usage:
            for event in events:
                event["usage"] = self._running_usage()
        return events

    def extra(self) -> dict[str, Any]:
        """Top-level fields besides choices (on the first chunk only when streaming)."""
        return {}

    def choice(self, index: int, response: generation_pb2.GenerateResponse, delta: bool = False) -> dict[str, Any]:
        raise NotImplementedError

    def _note(self, index: int, response: generation_pb2.GenerateResponse) -> None:
        if response.prompt_logprobs:
            self.prompt_logprobs = list(response.prompt_logprobs)
        if response.HasField("usage"):
            self.usages[index] = response.usage

    def _usage(self) -> dict[str, Any]:
        return usage_json(merged_usage([self.usages[i] for i in sorted(self.usages)]))

    def _running_usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class CompletionFormat(ResponseFormat):
    prefix, object_name, chunk_object_name = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, decoder: Decoder, parsed: ParsedRequest, prompt_text: str) -> None:
        super().__init__(model, decoder, parsed)
        self.prompt_text = prompt_text
        self.text_lengths = [0] * parsed.n  # characters of each choice's text so far, for logprobs' text_offset

    def choice(self, index: int, response: generation_pb2.GenerateResponse, delta: bool = False) -> dict[str, Any]:
        first = not self.started[index]
        self.started[index] = True
        text, logprobs = response.text, None
        count = self.parsed.logprobs_count
        if first and self.parsed.echo:
            text = self.prompt_text + text
            if self.parsed.logprobs:
                prompt_ids = self.parsed.generate.prompt_token_ids
                logprobs = echo_logprobs(prompt_ids[0], self.prompt_logprobs, self.decoder, count)
            self.text_lengths[index] = len(self.prompt_text)
        if self.parsed.logprobs:
            generated = completion_logprobs(list(response.logprobs), self.decoder, self.text_lengths[index], count)
            logprobs = generated if logprobs is None else {key: logprobs[key] + generated[key] for key in logprobs}
        self.text_lengths[index] += len(response.text)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(response)}
        if first and self.parsed.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_logprobs, self.decoder,
                                                             self.parsed.prompt_logprobs)
        return choice


class ChatFormat(ResponseFormat):
    prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, decoder: Decoder, parsed: ParsedRequest, tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        super().__init__(model, decoder, parsed)
        # The thinking apart from the answer (--reasoning-parser), each choice streamed through its own splitter.
        self.reasoning = reasoning_parser
        self._reasoning_streams = ([ReasoningStream(reasoning_parser, parsed.starts_thinking)
                                    for _ in range(parsed.n)] if reasoning_parser is not None else [])
        self.tool_mode = parsed.tools.choice if parsed.tools is not None else "none"
        if self.tool_mode == "auto" and tool_parser is None:
            raise ValueError('tool_choice "auto" needs a tool parser')
        self.tool_parser = tool_parser
        self._held = [""] * parsed.n  # "required": each choice's text, parsed at its end
        self._streams = [ToolCallStream(tool_parser) for _ in range(parsed.n)] if self.tool_mode == "auto" else []
        self._call_ids = [new_call_id() for _ in range(parsed.n)]  # "named": each choice's one call
        self._named_started = [False] * parsed.n  # "named", streamed: the call's head was sent

    def opening(self, index: int) -> list[dict[str, Any]]:
        # OpenAI's first chunk of a choice names the role; the content follows.
        first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{**self.head(self.chunk_object_name), "choices": [first]}]

    def extra(self) -> dict[str, Any]:
        # vLLM's prompt_logprobs: top level, as the prompt is shared by the choices; sent once.
        if self.parsed.prompt_logprobs is None or self.prompt_logprobs_sent:
            return {}
        self.prompt_logprobs_sent = True
        count = self.parsed.prompt_logprobs
        return {"prompt_logprobs": vllm_prompt_logprobs(self.prompt_logprobs, self.decoder, count)}

    def choice(self, index: int, response: generation_pb2.GenerateResponse, delta: bool = False) -> dict[str, Any]:
        self.started[index] = True
        logprobs = (chat_logprobs(list(response.logprobs), self.decoder, self.parsed.logprobs_count)
                    if self.parsed.logprobs else None)
        reason = finish_reason(response)
        text, thinking = response.text, None
        if self.reasoning is not None:
            if delta:
                stream = self._reasoning_streams[index]
                thinking, text = stream.feed(text)
                if reason is not None:
                    more_thinking, more_text = stream.finish()
                    thinking, text = thinking + more_thinking, text + more_text
            else:
                thinking, answer = self.reasoning.split(text, self.parsed.starts_thinking)
                text = answer or ""
        if self.tool_mode == "none":
            key, message = ("delta", {"content": text}) if delta else (
                "message", {"role": "assistant", "content": text})
        elif delta:
            message, called = self._tool_delta(index, text, reason is not None)
            key = "delta"
            if called and reason == "stop":
                reason = "tool_calls"
        else:
            content, calls = self._calls(index, text, reason)
            message = {"role": "assistant", "content": content}
            if calls:
                ids = [self._call_ids[index]] if self.tool_mode == "named" else [new_call_id() for _ in calls]
                message["tool_calls"] = [call.to_json(call_id) for call, call_id in zip(calls, ids)]
                if reason == "stop":
                    reason = "tool_calls"
            key = "message"
        if self.reasoning is not None and (thinking or not delta):
            message["reasoning_content"] = thinking or None
        return {"index": index, key: message, "logprobs": logprobs, "finish_reason": reason}

    def _calls(self, index: int, text: str, reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's content and tool calls, by the request's tool choice."""
        tools = self.parsed.tools
        assert tools is not None
        if self.tool_mode == "named":
            assert tools.name is not None
            return None, [ToolCall(tools.name, text)]
        if self.tool_mode == "required":
            calls = _listed_calls(text)
            return (None, calls) if calls else (text, [])
        assert self.tool_parser is not None
        return self.tool_parser.extract(text)

    def _tool_delta(self, index: int, text: str, last: bool) -> tuple[dict[str, Any], bool]:
        """One streamed response of a choice with tools: its delta, and whether the choice called a tool."""
        if self.tool_mode == "named":
            assert self.parsed.tools is not None and self.parsed.tools.name is not None
            if not text and not self._named_started[index]:
                return {"content": None}, last  # still thinking: the call has not begun
            piece: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self._named_started[index]:
                self._named_started[index] = True  # the call's head goes once, with the first piece
                piece = {"index": 0, "id": self._call_ids[index], "type": "function",
                         "function": {"name": self.parsed.tools.name, "arguments": text}}
            return {"content": None, "tool_calls": [piece]}, True
        if self.tool_mode == "required":
            self._held[index] += text
            if not last:
                return {"content": ""}, False
            calls = _listed_calls(self._held[index])
            if not calls:
                return {"content": self._held[index]}, False
            return {"content": None, "tool_calls": _call_deltas(calls)}, True
        stream = self._streams[index]
        content = stream.feed(text)
        if not last:
            return {"content": content}, False
        rest, calls = stream.finish()
        message: dict[str, Any] = {"content": content + rest}
        if calls:
            message["tool_calls"] = _call_deltas(calls)
        return message, bool(calls)


def _listed_calls(text: str) -> list[ToolCall]:
    """``tool_choice: "required"``'s answer: a JSON list of ``{"name": ..., "parameters": {...}}``; [] if the text
    is not one (a choice cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        calls.append(ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls


def _call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"index": position, **call.to_json(new_call_id())} for position, call in enumerate(calls)]
