"""OpenAI's JSON request bodies, translated to pdserve's GenerateRequest (responses: ``openai_responses``).

Pure functions: no I/O, so the translation is testable without a server.
Every top-level key a body may hold is named here, in ``COMPLETION_KEYS`` and
``CHAT_KEYS``: the ones pdserve honours, and the ones it accepts only with a
value that changes nothing about the output (``NO_OP_VALUES``). Anything else
is answered 400 naming the key, so no parameter is ever silently ignored.
"""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured_output import check_grammar
from pdserve.engine.types.structured_outputs import GrammarError, StructuredOutputsParams
from pdserve.gateway.reasoning_parsers import END as REASONING_END
from pdserve.gateway.reasoning_parsers import ReasoningParser
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.service_common.structured_outputs import structured_outputs_to_proto

DEFAULT_MAX_N = 16
# vLLM's older names of structured_outputs' kinds, still accepted.
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# What vLLM's structured_outputs object may hold that pdserve reads.
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag",
                           "disable_any_whitespace")

# vLLM's extensions that pdserve honours, on both endpoints.
VLLM_KEYS = frozenset({
    "top_k", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos", "prompt_logprobs",
    "skip_special_tokens", "structured_outputs", *GUIDED_KEYS,
})
_SHARED_KEYS = frozenset({
    "model", "n", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "max_tokens", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "response_format",
}) | VLLM_KEYS
COMPLETION_KEYS = _SHARED_KEYS | {"prompt", "best_of", "echo", "suffix"}
CHAT_KEYS = _SHARED_KEYS | {
    "messages", "max_completion_tokens", "top_logprobs", "audio", "function_call", "functions", "metadata",
    "modalities", "moderation", "parallel_tool_calls", "prediction", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "service_tier", "store",
    "tool_choice", "tools", "verbosity", "web_search_options",
}


class InvalidRequest(ValueError):
    """A request body OpenAI's API would refuse; answered 400 with ``param`` naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _is_string(value: Any) -> bool:
    return isinstance(value, str)


def _is_string_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


# Keys accepted only with values that change nothing about the output (null is
# always accepted: OpenAI reads it as unset); any other value is refused 400.
# name -> (accepts, what is accepted, why nothing else is)
NO_OP_VALUES: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "user": (_is_string, "a string", "an end-user id; pdserve does not use it"),
    "safety_identifier": (_is_string, "a string", "an end-user id; pdserve does not use it"),
    "prompt_cache_key": (_is_string, "a string", "pdserve's prefix cache matches prompts by content"),
    "metadata": (_is_string_map, "an object of strings", "pdserve does not store completions"),
    "store": (lambda v: v is False, "false", "pdserve does not store completions"),
    "suffix": (lambda v: v == "", '""', "pdserve does not insert text (no fill-in-the-middle)"),
    "modalities": (lambda v: v == ["text"], '["text"]', "pdserve answers in text only"),
    "functions": (lambda v: v == [], "[]", "functions is OpenAI's deprecated name: use tools"),
    "function_call": (lambda v: v == "none", '"none"', "function_call is OpenAI's deprecated name: use tool_choice"),
    "service_tier": (lambda v: v in ("auto", "default"), '"auto" or "default"', "pdserve has one tier"),
    "prompt_cache_retention": (lambda v: v == "in_memory", '"in_memory"', "pdserve's cache lives in worker memory"),
    # Accepted only as null: each would change the output or promise what pdserve does not do.
    "audio": (lambda v: False, "null", "pdserve answers in text only"),
    "moderation": (lambda v: False, "null", "pdserve has no moderation"),
    "prediction": (lambda v: False, "null", "pdserve has no predicted outputs"),
    "prompt_cache_options": (lambda v: False, "null", "pdserve makes no promise of cache lifetime"),
    "reasoning_effort": (lambda v: False, "null", "the served models do not reason on a budget"),
    "verbosity": (lambda v: False, "null", "pdserve does not steer verbosity"),
    "web_search_options": (lambda v: False, "null", "pdserve does not search the web"),
}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools: ``choice`` is "none", "auto" (the parser finds calls in free text), "required"
    (a JSON array of calls, enforced by structured output) or "named" (``name``'s arguments, enforced too)."""

    choice: str
    names: tuple[str, ...]
    name: str | None = None
    parallel: bool = True


@dataclass(frozen=True)
class ParsedRequest:
    """What the HTTP layer needs from a completions or chat body.

    ``generate`` is choice 0's request; ``choice_requests`` derives all ``n``.
    """

    generate: generation_pb2.GenerateRequest
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage on every streamed chunk (vLLM's stream_options.continuous_usage_stats)
    logprobs: bool  # whether to return them at all (chat's logprobs may be true with top_logprobs 0)
    logprobs_count: int  # alternatives per token in the answer's logprobs
    echo: bool = False  # completions: the prompt is prepended to each choice's text (and logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs as asked (returned as its own field)
    tools: ToolRequest | None = None  # chat with tools: how the answer's tool calls are found
    # Chat with a --reasoning-parser: whether the output begins inside the thinking (None: no parser).
    starts_thinking: bool | None = None

    def choice_requests(self) -> list[generation_pb2.GenerateRequest]:
        """One request per choice: choice i samples with seed + i; only choice 0 computes prompt logprobs.

        Choices 1..n-1 then hit the prefix cache that choice 0 filled (a request
        asking for prompt logprobs computes its whole prompt).
        """
        requests = []
        for index in range(self.n):
            request = generation_pb2.GenerateRequest()
            request.CopyFrom(self.generate)
            params = request.sampling_params
            if index and params.HasField("seed"):
                params.seed += index
            if index and params.HasField("prompt_logprobs"):
                params.ClearField("prompt_logprobs")
            requests.append(request)
        return requests


def parse_completion(body: Mapping[str, Any], max_n: int = DEFAULT_MAX_N) -> ParsedRequest:
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (one prompt only)."""
    _check_keys(body, COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    request = generation_pb2.GenerateRequest()
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise InvalidRequest("prompt token ids must be >= 0", "prompt")
        _assign(lambda: request.prompt_token_ids.extend(prompt), "prompt", "token ids must be below 2**32")
    else:
        raise InvalidRequest("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    logprobs = _optional(body, "logprobs", int)
    echo = bool(_optional(body, "echo", bool))
    n = _choices(body, max_n)
    best_of = _optional(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise InvalidRequest(f"best_of must equal n ({n}): this server returns every sample it draws, got {best_of}",
                             "best_of")
    params = request.sampling_params
    _sampling_params(body, params, body.get("max_tokens"), logprobs)
    prompt_logprobs = params.prompt_logprobs if params.HasField("prompt_logprobs") else None
    if echo and logprobs is not None:
        # The prompt's tokens come first in logprobs, with as many alternatives as the completion's.
        params.prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    return ParsedRequest(request, n, *_stream_flags(body), logprobs is not None, logprobs or 0, echo, prompt_logprobs)


def parse_chat(body: Mapping[str, Any], tokenizer: Any, max_n: int = DEFAULT_MAX_N,
               auto_tool_choice: bool = False, reasoning: ReasoningParser | None = None) -> ParsedRequest:
    """``POST /v1/chat/completions``: the messages (and tools) through the tokenizer's chat template.
    ``auto_tool_choice``: the gateway parses tool calls out of free text (``--enable-auto-tool-choice`` with a
    ``--tool-call-parser``), so ``tool_choice: "auto"`` is served."""
    _check_keys(body, CHAT_KEYS)
    messages = chat_messages(body.get("messages"))
    if tokenizer is None:
        raise InvalidRequest("chat needs the model's tokenizer, and this gateway has none; use /v1/completions "
                             "with token ids", "messages")
    tools, tool_request = _tools(body, auto_tool_choice, tokenizer)
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                **({"tools": tools} if tools else {}))
    except Exception as error:  # noqa: BLE001 - a template's own error, reported to the caller
        raise InvalidRequest(f"messages do not fit the model's chat template: {error}", "messages") from error
    token_ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    request = generation_pb2.GenerateRequest(prompt_token_ids=list(token_ids))
    wants_logprobs = bool(_optional(body, "logprobs", bool))
    top_logprobs = _optional(body, "top_logprobs", int)
    if top_logprobs is not None and not wants_logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
    n = _choices(body, max_n)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise InvalidRequest("set max_completion_tokens or max_tokens, not both", "max_tokens")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = request.sampling_params
    _sampling_params(body, params, max_tokens, (top_logprobs or 0) if wants_logprobs else None)
    if tool_request is not None and tool_request.choice in ("required", "named"):
        if params.HasField("structured_outputs"):
            raise InvalidRequest(f"tool_choice {_short(body.get('tool_choice'))} constrains the answer to tool calls "
                                 "and cannot be combined with response_format or structured_outputs", "tool_choice")
        schema = _tool_call_schema(tools, tool_request)
        spec = StructuredOutputsParams(json=schema, field_name="tools")
        try:
            check_grammar(spec)
        except GrammarError as error:
            raise InvalidRequest(f"the tools' parameters do not compile as JSON schemas: {error}", "tools") from None
        params.structured_outputs.CopyFrom(structured_outputs_to_proto(spec))
    starts_thinking = None
    if reasoning is not None:
        # Whether the template opened the thinking for the model (DeepSeek-R1 always thinks first).
        starts_thinking = reasoning.thinks_from_start(tokenizer.decode(list(token_ids[-64:])))
        if starts_thinking and params.HasField("structured_outputs"):
            # The grammar holds the answer only: it starts after the thinking ends.
            params.structured_outputs.reasoning_end = REASONING_END
    prompt_logprobs = params.prompt_logprobs if params.HasField("prompt_logprobs") else None
    return ParsedRequest(request, n, *_stream_flags(body), wants_logprobs, top_logprobs or 0, False, prompt_logprobs,
                         tool_request, starts_thinking)


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _tools(body: Mapping[str, Any], auto_tool_choice: bool, tokenizer: Any
           ) -> tuple[list[dict[str, Any]], ToolRequest | None]:
    """The request's tools as the chat template reads them, and how its answer's calls are found."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequest("tools must be a list of tool objects", "tools")
        if choice not in (None, "none"):
            raise InvalidRequest(f"tool_choice {_short(choice)} needs tools", "tool_choice")
        return [], None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of tool objects", "tools")
    rendered, names = [], []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        for key in tool:
            if key not in ("type", "function"):
                raise InvalidRequest(f"{where}.{key} is not supported", f"{where}.{key}")
        function = tool["function"]
        for key in function:
            if key not in _FUNCTION_KEYS:
                raise InvalidRequest(f"{where}.function.{key} is not supported ({', '.join(_FUNCTION_KEYS)} are)",
                                     f"{where}.function.{key}")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidRequest(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {_short(name)}",
                                 f"{where}.function.name")
        if name in names:
            raise InvalidRequest(f"{where}.function.name {name!r} names another tool too", f"{where}.function.name")
        _optional(function, "description", str, f"{where}.function.description")
        _optional(function, "strict", bool, f"{where}.function.strict")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object",
                                 f"{where}.function.parameters")
        names.append(name)
        rendered.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    if not _template_renders_tools(tokenizer):
        raise InvalidRequest("the model's chat template does not render tools (it never reads `tools`); send "
                             "the request without them", "tools")
    parallel = _optional(body, "parallel_tool_calls", bool)
    parallel = True if parallel is None else parallel
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                 '"function": {"name": ...}}', "tool_choice")
        if function["name"] not in names:
            raise InvalidRequest(f"tool_choice names {function['name']!r}, which is not among the tools "
                                 f"({', '.join(names)})", "tool_choice")
        return rendered, ToolRequest("named", tuple(names), function["name"], parallel)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequest(f'tool_choice must be "none", "auto", "required" or a named function, got {_short(choice)}',
                             "tool_choice")
    if choice == "auto" and not auto_tool_choice:
        raise InvalidRequest('tool_choice "auto" (the default with tools) needs the server started with '
                             "--enable-auto-tool-choice and a --tool-call-parser; or ask for \"required\", "
                             "a named function, or \"none\"", "tool_choice")
    return rendered, ToolRequest(choice, tuple(names), None, parallel)


def _tool_call_schema(tools: list[dict[str, Any]], request: ToolRequest) -> dict[str, Any]:
    """What structured output holds the answer to: the named function's arguments, or a list of calls (at
    least one; exactly one without parallel_tool_calls), each ``{"name": ..., "parameters": {...}}`` (vLLM's)."""
    parameters = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"} for tool in tools}
    if request.choice == "named":
        assert request.name is not None
        return parameters[request.name]
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in parameters.items()]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not request.parallel:
        array["maxItems"] = 1
    return array


def _template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(value) for value in template.values())
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def _check_keys(body: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(key for key in body if key not in known)
    if unknown:
        raise InvalidRequest(f"unknown parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                             "(this server refuses what it would not honour)", unknown[0])
    _optional(body, "model", str)  # any name: the gateway serves one model
    for name, (accepts, accepted, reason) in NO_OP_VALUES.items():
        value = body.get(name)
        if value is not None and name in known and not accepts(value):
            raise InvalidRequest(f"{name} may only be {accepted} (or null) here: {reason}; got {_short(value)}", name)


# Message roles and the role the chat template sees: OpenAI's "developer" is
# its newer name for "system" (vLLM renders it as system too).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_KEYS = {"system": ("role", "content", "name"), "user": ("role", "content", "name"),
                 "assistant": ("role", "content", "name", "tool_calls"), "tool": ("role", "content", "tool_call_id")}
_PART_KEYS = ("type", "prompt_cache_breakpoint")  # a cache breakpoint is a hint: pdserve caches every full block


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI's messages as a chat template reads them: text content; system, user, assistant (with its
    ``tool_calls``, their arguments as objects, as vLLM hands them to templates) and tool roles.

    Content given as a list of text parts is joined with newlines (as vLLM
    does for templates that take a string).
    """
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise InvalidRequest("messages must be a non-empty list of message objects", "messages")
    rendered = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = message.get("role")
        if role == "function":
            raise InvalidRequest(f"{where}.role 'function' is OpenAI's deprecated name: use 'tool'", f"{where}.role")
        if role not in _ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(_ROLES)}, got {_short(role)}",
                                 f"{where}.role")
        role = _ROLES[role]
        for key in message:
            if key not in _MESSAGE_KEYS[role]:
                raise InvalidRequest(f"{where}.{key} is not supported in a {role} message (it holds "
                                     f"{', '.join(_MESSAGE_KEYS[role])})", f"{where}.{key}")
        content = message.get("content")
        calls = message.get("tool_calls")
        entry: dict[str, Any] = {"role": role}
        if role == "assistant" and calls is not None:
            entry["content"] = "" if content is None else _message_text(content, where, role)
            entry["tool_calls"] = _message_tool_calls(calls, f"{where}.tool_calls")
        else:
            entry["content"] = _message_text(content, where, role)
        name = message.get("name")
        if name is not None:
            entry["name"] = _typed(f"{where}.name", name, str)
        if role == "tool":
            entry["tool_call_id"] = _typed(f"{where}.tool_call_id", message.get("tool_call_id"), str)
        rendered.append(entry)
    return rendered


def _message_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list of tool calls", where)
    rendered = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequest(f'{at} must be {{"id": ..., "type": "function", "function": {{"name", "arguments"}}}}',
                                 at)
        name = _typed(f"{at}.function.name", function.get("name"), str)
        arguments = _typed(f"{at}.function.arguments", function.get("arguments", "{}"), str)
        try:
            decoded = json.loads(arguments)
        except ValueError:
            raise InvalidRequest(f"{at}.function.arguments must be a JSON object's text", f"{at}.function.arguments") \
                from None
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": decoded}}
        if call.get("id") is not None:
            entry["id"] = _typed(f"{at}.id", call["id"], str)
        rendered.append(entry)
    return rendered


def _message_text(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InvalidRequest(f"{where}.content must be a string or a non-empty list of content parts",
                             f"{where}.content")
    texts = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(part, dict):
            raise InvalidRequest(f"{at} must be a content part object", at)
        kind = part.get("type")
        # OpenAI allows an assistant's refusal as a part of its message; vLLM reads it as text too.
        text_key = "text" if kind == "text" else "refusal" if kind == "refusal" and role == "assistant" else None
        if text_key is None:
            raise InvalidRequest(f"{at}.type {_short(kind)} is not supported: this server reads text parts only "
                                 "(and refusal parts of assistant messages)", f"{at}.type")
        for key in part:
            if key not in (text_key, *_PART_KEYS):
                raise InvalidRequest(f"{at}.{key} is not supported in a {kind} part", f"{at}.{key}")
        texts.append(_typed(f"{at}.{text_key}", part.get(text_key), str))
    return "\n".join(texts)


def _choices(body: Mapping[str, Any], max_n: int) -> int:
    n = _optional(body, "n", int)
    if n is None:
        return 1
    if not 1 <= n <= max_n:
        raise InvalidRequest(f"n must be in [1, {max_n}] (this server's --max-n), got {n}", "n")
    return n


def _sampling_params(
    body: Mapping[str, Any], params: generation_pb2.SamplingParams, max_tokens: Any, logprobs: int | None
) -> None:
    """Type checks only; ranges are the gateway's validation's, so both APIs refuse the same values."""
    if max_tokens is not None:
        _set(params, "max_tokens", _typed("max_tokens", max_tokens, int))
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _optional(body, name, float)
        if value is not None:
            setattr(params, name, value)
    for name in ("top_k", "seed", "min_tokens", "prompt_logprobs"):
        value = _optional(body, name, int)
        if value is not None:
            _set(params, name, value)
    stop = body.get("stop")
    if isinstance(stop, str):
        params.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        params.stop.extend(stop)
    elif stop is not None:
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, list) or not all(_is_token_id(t) for t in stop_token_ids):
            raise InvalidRequest("stop_token_ids must be a list of token ids (integers >= 0)", "stop_token_ids")
        _assign(lambda: params.stop_token_ids.extend(stop_token_ids), "stop_token_ids", "ids must be below 2**32")
    _logit_bias(body.get("logit_bias"), params)
    if logprobs is not None:
        _set(params, "logprobs", logprobs)
    params.ignore_eos = bool(_optional(body, "ignore_eos", bool))  # vLLM's extension
    skip_special_tokens = _optional(body, "skip_special_tokens", bool)  # vLLM's extension
    if skip_special_tokens is not None:
        params.skip_special_tokens = skip_special_tokens
    spec = structured_outputs(body)
    if spec is not None:
        params.structured_outputs.CopyFrom(structured_outputs_to_proto(spec))


def structured_outputs(body: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """What the body asks the output to match: OpenAI's ``response_format``, vLLM's ``structured_outputs``
    object or one of its older ``guided_*`` fields (at most one of them); checked with the grammar engine, so
    a spec that does not compile is a 400 naming its field. None: free text."""
    asked = []
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        asked.append("response_format")
    asked += [key for key in ("structured_outputs", *GUIDED_KEYS) if body.get(key) is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidRequest(f"set one of {', '.join(asked)}: each constrains the output on its own", asked[1])
    key = asked[0]
    try:
        if key == "response_format":
            spec = _response_format(response_format)
        elif key == "structured_outputs":
            spec = _structured_outputs_object(body[key])
        else:
            value = body[key]
            if key == "guided_choice" and isinstance(value, list):
                value = tuple(value)
            if key == "guided_json" and isinstance(value, dict):
                spec = StructuredOutputsParams(json=value, field_name=key)
            else:
                spec = StructuredOutputsParams(**{GUIDED_KEYS[key]: value}, field_name=key)
        check_grammar(spec)
    except GrammarError as error:
        message = str(error)
        raise InvalidRequest(message, message.split(" ", 1)[0].rstrip(":")) from None
    return spec


def _response_format(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise InvalidRequest("response_format must be an object", "response_format")
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, field_name="response_format")
    if kind == "structural_tag":  # vLLM's: the tag's structures and triggers beside the type
        return StructuredOutputsParams(structural_tag=dict(value), field_name="response_format")
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema must be an object holding name and schema",
                                 "response_format.json_schema")
        _typed("response_format.json_schema.name", schema.get("name"), str)
        for key in schema:
            if key not in ("name", "schema", "strict", "description"):
                raise InvalidRequest(f"response_format.json_schema.{key} is not supported (name, schema, strict, "
                                     "description are)", f"response_format.json_schema.{key}")
        _optional(schema, "strict", bool, "response_format.json_schema.strict")
        _optional(schema, "description", str, "response_format.json_schema.description")
        if not isinstance(schema.get("schema"), dict):
            raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                                 "response_format.json_schema.schema")
        return StructuredOutputsParams(json=schema["schema"], field_name="response_format.json_schema.schema")
    raise InvalidRequest("response_format.type must be one of text, json_object, json_schema, structural_tag; got "
                         f"{_short(kind)}", "response_format.type")


def _structured_outputs_object(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs must be an object", "structured_outputs")
    for key in value:
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise InvalidRequest(f"structured_outputs.{key} is not supported (this server reads "
                                 f"{', '.join(STRUCTURED_OUTPUTS_KEYS)})", f"structured_outputs.{key}")
    fields = {key: item for key, item in value.items() if item is not None}
    if isinstance(fields.get("choice"), list):
        fields["choice"] = tuple(fields["choice"])
    kinds = [key for key in fields if key != "disable_any_whitespace"]
    field_name = f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs"
    return StructuredOutputsParams(**fields, field_name=field_name)


def _logit_bias(bias: Any, params: generation_pb2.SamplingParams) -> None:
    """OpenAI's ``{"token id": bias}``; the keys are strings in JSON."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= 2**32:
            raise InvalidRequest(f"logit_bias keys must be token ids (integers >= 0), got {key!r}", "logit_bias")
        params.logit_bias[int(key)] = _typed(f"logit_bias[{key!r}]", value, float, "logit_bias")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    stream = bool(_optional(body, "stream", bool))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", "stream_options")
    if options and not stream:
        raise InvalidRequest("stream_options is only allowed with stream: true", "stream_options")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise InvalidRequest(f"unknown stream option {key!r}: include_usage and continuous_usage_stats are "
                                 "supported", f"stream_options.{key}")
    include_usage = _optional(options, "include_usage", bool, "stream_options.include_usage")
    continuous = _optional(options, "continuous_usage_stats", bool, "stream_options.continuous_usage_stats")
    return stream, bool(include_usage), bool(continuous)


def _optional(body: Mapping[str, Any], name: str, kind: type, param: str | None = None) -> Any:
    value = body.get(name)
    return None if value is None else _typed(param or name, value, kind)


def _typed(name: str, value: Any, kind: type, param: str | None = None) -> Any:
    # bool is an int in Python, and JSON's true is not a token count.
    ok = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise InvalidRequest(f"{name} must be {_KIND_NAMES[kind]}, got {_short(value)}", param or name)
    return value


_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _set(params: generation_pb2.SamplingParams, name: str, value: int) -> None:
    _assign(lambda: setattr(params, name, value), name, f"got {value}")


def _assign(assign: Callable[[], None], param: str, detail: str) -> None:
    """A protobuf assignment; an integer too large for the field is the caller's error, not a 500."""
    try:
        assign()
    except (ValueError, TypeError) as error:
        raise InvalidRequest(f"{param} is out of range: {detail}", param) from error


def _short(value: Any) -> str:
    # Bounded in depth and length: an error message stays short whatever was sent.
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60
