"""Tool calls through the official openai client: named and required tool choices enforced by structured
output, "auto" found by the gateway's --tool-call-parser, streamed and not; histories with tool calls; the 400s."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from pdserve.gateway.openai_protocol import InvalidRequest, parse_chat
from pdserve.gateway.tokenizer import load_tokenizer
from pdserve.gateway.tool_parsers import PARSERS, tool_parser
from tests.http.conftest import SPECIAL_TOKENS, build_byte_tokenizer
from tests.structured.conftest import served

# A Hermes-style template: the tools in a system turn, calls as <tool_call> blocks, tool results as "tool" turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                  "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "unit": "C"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def tools_llama(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tiny-llama-tools")
    for path in chat_checkpoint.iterdir():
        shutil.copy(path, directory / path.name)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


# Id 5 is [TOOL_CALLS] in Mistral's v3 tokenizer (Mistral-7B-Instruct-v0.3), a special token there as here.
TOOL_CALLS_ID = 5
MISTRAL_SPECIAL_TOKENS = [*SPECIAL_TOKENS[:TOOL_CALLS_ID], "[TOOL_CALLS]", *SPECIAL_TOKENS[TOOL_CALLS_ID + 1:]]


@pytest.fixture(scope="module")
def tools_mistral(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with the byte tokenizer, its special token 5 being [TOOL_CALLS], and the tools template."""
    directory = tmp_path_factory.mktemp("tiny-llama-mistral-tools")
    for path in llama_checkpoint.iterdir():
        shutil.copy(path, directory / path.name)
    tokenizer: Any = build_byte_tokenizer(directory, MISTRAL_SPECIAL_TOKENS)
    assert tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") == TOOL_CALLS_ID
    assert TOOL_CALLS_ID in tokenizer.all_special_ids
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def _check_calls(calls: Any, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def _streamed(client: openai.AsyncOpenAI, **args: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """A streamed chat's content, its tool calls put together from their pieces (by index), its finish reason."""
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True, **args)
    content, calls, reason = "", {}, None
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            call["name"] += (piece.function.name or "") if piece.function else ""
            call["arguments"] += (piece.function.arguments or "") if piece.function else ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


@pytest.mark.asyncio
async def test_a_named_tool_choice_always_calls_it_with_valid_arguments(tools_llama: Path) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with served(tools_llama) as (_, client):
        reply = await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=named,  # type: ignore[arg-type]
                                                     max_tokens=80, temperature=1.0, seed=4)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls, {"get_weather"})
        content, calls, reason = await _streamed(client, tools=TOOLS, tool_choice=named, max_tokens=80,
                                                 temperature=1.0, seed=4)
        assert (content, reason) == ("", "tool_calls") and list(calls) == [0]
        assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("chatcmpl-tool-")
        assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments  # type: ignore[index]


@pytest.mark.asyncio
async def test_required_calls_listed_tools_one_without_parallel_calls(tools_llama: Path) -> None:
    async with served(tools_llama) as (_, client):
        for seed in range(3):
            reply = await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,  # type: ignore[arg-type]
                                                         tool_choice="required", parallel_tool_calls=False,
                                                         max_tokens=120, temperature=1.0, seed=seed)
            assert reply.choices[0].finish_reason == "tool_calls"
            calls = reply.choices[0].message.tool_calls
            assert calls is not None and len(calls) == 1
            _check_calls(calls, {"get_weather", "get_time"})
        content, streamed, reason = await _streamed(client, tools=TOOLS, tool_choice="required", max_tokens=200,
                                                    temperature=1.0, seed=9)
        assert content == "" and reason == "tool_calls" and list(streamed) == list(range(len(streamed)))
        for call in streamed.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.asyncio
async def test_auto_finds_hermes_calls_in_the_answer_and_leaves_plain_answers_alone(tools_llama: Path) -> None:
    # The tiny random model writes no tool call of its own: a regex makes it write one in Hermes' format.
    calling = {"structured_outputs": {"regex": r"Let me check\. " + HERMES_CALL}}
    async with served(tools_llama, tool_call_parser="hermes") as (_, client):
        reply = await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=200,  # type: ignore[arg-type]
                                                     temperature=0.0, extra_body=calling)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        _check_calls(choice.message.tool_calls, {"get_weather"})
        content, calls, reason = await _streamed(client, tools=TOOLS, max_tokens=200, temperature=0.0,
                                                 extra_body=calling)
        assert (content, reason) == ("Let me check. ", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            ("get_weather", choice.message.tool_calls[0].function.arguments)]  # type: ignore[index]
        plain = {"structured_outputs": {"regex": "[a-z]{2,6} <[a-z]{2,6}> [a-z]{2,6}"}}
        reply = await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="auto",  # type: ignore[arg-type]
                                                     max_tokens=40, temperature=0.0, extra_body=plain)
        assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.tool_calls is None
        content, calls, reason = await _streamed(client, tools=TOOLS, max_tokens=40, temperature=0.0, extra_body=plain)
        assert (content, calls, reason) == (reply.choices[0].message.content, {}, "stop")


# What Llama 3.1-3.3 write with vLLM's JSON tool template: one JSON object per call, "parameters" for the arguments,
# several separated by "; ", after <|python_tag|> when they write it (a special token of their tokenizer, which the
# worker's detokenizer drops; the byte tokenizer here writes it as text). A call cut short is not JSON: it stays text.
LLAMA3_JSON_OUTPUTS = [
    ('{"name": "get_weather", "parameters": {"city": "paris", "unit": "C"}}',
     None, [("get_weather", '{"city": "paris", "unit": "C"}')]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "paris", "unit": "C"}}; '
     '{"name": "get_time", "parameters": {"zone": -5}}',
     None, [("get_weather", '{"city": "paris", "unit": "C"}'), ("get_time", '{"zone": -5}')]),
    ('{"name": "get_weather", "parameters": {"city": "paris", "unit": "C"}',
     '{"name": "get_weather", "parameters": {"city": "paris", "unit": "C"}', []),
]
# What Mistral's instruct models (tokenizer v3, e.g. Mistral-7B-Instruct-v0.3, Mistral-Nemo) write: [TOOL_CALLS], then
# one JSON list of the calls, "arguments" for the arguments; text may come first. [TOOL_CALLS] is a special token of
# their tokenizers (and of tools_mistral's), which the text leaves out unless the request sets skip_special_tokens
# false: the mistral parser does, for requests with tools.
MISTRAL_OUTPUTS = [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "paris", "unit": "C"}}]',
     None, [("get_weather", '{"city": "paris", "unit": "C"}')]),
    ('Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "paris", "unit": "C"}}, '
     '{"name": "get_time", "arguments": {"zone": -5}}]',
     "Let me check.", [("get_weather", '{"city": "paris", "unit": "C"}'), ("get_time", '{"zone": -5}')]),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "paris", "unit": "C"}]',
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "paris", "unit": "C"}]', []),
]
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def _literal(text: str) -> str:
    """A regex that matches ``text`` only."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def _written_with_tool_calls_token(text: str) -> str:
    """A Lark grammar that matches ``text`` only, each ``[TOOL_CALLS]`` in it being the special token (by its id),
    never the characters."""
    parts = []
    for index, piece in enumerate(text.split("[TOOL_CALLS]")):
        if index:
            parts.append(f"<[{TOOL_CALLS_ID}]>")
        if piece:
            parts.append(json.dumps(piece))
    return "start: " + " ".join(parts)


async def _chunks(client: openai.AsyncOpenAI, **args: Any) -> list[tuple[str | None, list[dict[str, Any]] | None,
                                                                          str | None]]:
    """A streamed chat's chunks as they came: each one's content, tool calls and finish reason."""
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True, **args)
    chunks = []
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            calls = [call.model_dump(exclude_none=True) for call in delta.tool_calls] if delta.tool_calls else None
            chunks.append((delta.content, calls, chunk.choices[0].finish_reason))
    return chunks


async def _check_auto_calls(client: openai.AsyncOpenAI, output: str, content: str | None,
                            calls: list[tuple[str, str]], constraint: dict[str, str] | None = None) -> None:
    """The model writes ``output`` (``constraint``, by default a regex, makes the tiny random model write it): the
    reply, whole and streamed, has ``content`` and ``calls`` (name, arguments), ends with "tool_calls" when it has
    calls and "stop" when not."""
    args: dict[str, Any] = dict(tools=TOOLS, max_tokens=300, temperature=0.0,
                                extra_body={"structured_outputs": constraint or {"regex": _literal(output)}})
    reply = await client.chat.completions.create(model="m", messages=MESSAGES, **args)
    choice = reply.choices[0]
    assert choice.message.content == content, output
    assert choice.finish_reason == ("tool_calls" if calls else "stop"), output
    got = choice.message.tool_calls or []
    assert [(call.type, call.function.name, call.function.arguments) for call in got] == [
        ("function", name, arguments) for name, arguments in calls], output
    assert all(CALL_ID.fullmatch(call.id) for call in got) and len({call.id for call in got}) == len(got), output

    chunks = await _chunks(client, **args)
    # Text before the calls streams as it comes; from the calls' first character on nothing goes out until the
    # choice ends, and its last chunk then carries every call, whole, with its index and a fresh id.
    assert "".join(text or "" for text, _, _ in chunks) == (content or ""), output
    assert [reason for _, _, reason in chunks[:-1]] == [None] * (len(chunks) - 1), output
    *before, (last_text, last_calls, last_reason) = chunks
    assert all(streamed is None for _, streamed, _ in before), output
    assert last_reason == ("tool_calls" if calls else "stop"), output
    if not calls:
        assert last_calls is None, output
        return
    assert last_text == "", output
    assert last_calls is not None
    assert [{key: value for key, value in call.items() if key != "id"} for call in last_calls] == [
        {"index": index, "type": "function", "function": {"name": name, "arguments": arguments}}
        for index, (name, arguments) in enumerate(calls)], output
    ids = [call["id"] for call in last_calls]
    assert all(CALL_ID.fullmatch(call_id) for call_id in ids) and len(set(ids)) == len(ids), output


@pytest.mark.asyncio
async def test_auto_finds_llama3_json_calls_one_or_several_and_leaves_a_broken_one_as_text(tools_llama: Path) -> None:
    async with served(tools_llama, tool_call_parser="llama3_json") as (_, client):
        for output, content, calls in LLAMA3_JSON_OUTPUTS:
            await _check_auto_calls(client, output, content, calls)


@pytest.mark.asyncio
async def test_auto_finds_mistral_calls_one_or_several_and_leaves_a_broken_list_as_text(tools_mistral: Path) -> None:
    # The model writes [TOOL_CALLS] as the special token: the calls are found only if the text keeps it.
    async with served(tools_mistral, tool_call_parser="mistral") as (_, client):
        for output, content, calls in MISTRAL_OUTPUTS:
            await _check_auto_calls(client, output, content, calls,
                                    {"grammar": _written_with_tool_calls_token(output)})


def test_the_mistral_parser_keeps_special_tokens_in_requests_that_may_call_tools_and_no_other_parser_does(
    tools_mistral: Path,
) -> None:
    tokenizer = load_tokenizer(str(tools_mistral))

    def adjusted(parser: str, **body: Any) -> tuple[bool, bool]:
        """Whether the request the parser adjusted sets skip_special_tokens, and to what."""
        parsed = tool_parser(parser).adjust_request(parse_chat({"model": "m", "messages": MESSAGES, **body},
                                                                tokenizer, auto_tool_choice=True))
        params = parsed.generate.sampling_params
        return params.HasField("skip_special_tokens"), params.skip_special_tokens

    assert adjusted("mistral", tools=TOOLS) == (True, False)  # tool_choice "auto"
    assert adjusted("mistral", tools=TOOLS, tool_choice="required") == (True, False)
    assert adjusted("mistral", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}) == (
        True, False)
    assert adjusted("mistral", tools=TOOLS, skip_special_tokens=True) == (True, False)  # as vLLM's parser does
    assert adjusted("mistral", tools=TOOLS, tool_choice="none") == (False, False)
    assert adjusted("mistral", tools=TOOLS, tool_choice="none", skip_special_tokens=False) == (True, False)
    assert adjusted("mistral") == (False, False)
    for parser in sorted(set(PARSERS) - {"mistral"}):
        assert adjusted(parser, tools=TOOLS) == (False, False), parser
        assert adjusted(parser, tools=TOOLS, skip_special_tokens=True) == (True, True), parser


@pytest.mark.asyncio
async def test_a_history_with_calls_and_results_is_served(tools_llama: Path) -> None:
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees, sunny"},
    ]
    async with served(tools_llama) as (_, client):
        reply = await client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                                     max_tokens=6, temperature=0.0)
        assert reply.choices[0].message.tool_calls is None and reply.usage is not None
        without = await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                                       max_tokens=6, temperature=0.0)
        assert without.usage is not None and reply.usage.prompt_tokens > without.usage.prompt_tokens


def test_the_template_gets_the_tools_and_the_history_with_arguments_as_objects(tools_llama: Path) -> None:
    tokenizer = load_tokenizer(str(tools_llama))
    calls: list[dict[str, Any]] = []
    original = tokenizer.apply_chat_template

    def recording(messages: Any, **kwargs: Any) -> Any:
        calls.append({"messages": messages, **kwargs})
        return original(messages, **kwargs)

    tokenizer.apply_chat_template = recording
    body = {"model": "m", "tools": TOOLS, "tool_choice": "required", "messages": [
        *MESSAGES, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_time", "arguments": '{"zone": 2}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "14:00"}]}
    parsed = parse_chat(body, tokenizer)
    (call,) = calls
    assert call["tools"] == TOOLS
    assert call["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"zone": 2}}, "id": "c"}]}
    assert call["messages"][2] == {"role": "tool", "content": "14:00", "tool_call_id": "c"}
    assert parsed.tools is not None and parsed.tools.choice == "required"
    schema = json.loads(parsed.generate.sampling_params.structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"] for item in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                                {"const": "get_time"}]


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        (dict(tool_choice={"type": "function", "function": {"name": "book_flight"}}), "tool_choice",
         "not among the tools"),
        (dict(tool_choice="auto"), "tool_choice", "--enable-auto-tool-choice"),
        (dict(), "tool_choice", "--enable-auto-tool-choice"),  # "auto" is the default with tools
        (dict(tool_choice="sometimes"), "tool_choice", "tool_choice must be"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}], tool_choice="required"),
         "tools[0].function.name", "letters, digits"),
        (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "tools[1].function.name", "names another tool"),
        (dict(tools=[{"type": "retrieval"}], tool_choice="required"), "tools[0]", '"type": "function"'),
        (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice", "cannot be combined"),
        (dict(tools=None, tool_choice="required"), "tool_choice", "needs tools"),
    ],
)
def test_bad_tool_requests_are_refused_naming_the_field(tools_llama: Path, extra: dict[str, Any], param: str,
                                                        text: str) -> None:
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, **extra}
    with pytest.raises(InvalidRequest) as caught:
        parse_chat(body, load_tokenizer(str(tools_llama)))
    assert caught.value.param == param and text in str(caught.value)


def test_a_template_that_cannot_render_tools_is_refused(chat_checkpoint: Path) -> None:
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    with pytest.raises(InvalidRequest) as caught:
        parse_chat(body, load_tokenizer(str(chat_checkpoint)))
    assert caught.value.param == "tools" and "does not render tools" in str(caught.value)
