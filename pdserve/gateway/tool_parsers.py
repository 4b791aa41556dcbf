"""Tool calls in a model's output, in the formats the served families emit (vLLM's ``--tool-call-parser`` names).

A parser splits a complete output into its text and its calls; while streaming, ``ToolCallStream`` passes text
through until a parser's opening marker may begin, then holds the rest and parses it when the choice ends.
Malformed calls (not JSON, no name) are left in the text, as vLLM leaves them. Before a chat request is sent,
its parser may adjust it (``adjust_request``, vLLM's hook), e.g. to keep its marker in the text.

- ``hermes`` (Qwen2.5/Qwen3, Hermes, many fine-tunes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
- ``llama3_json`` (Llama 3.1-3.3): the whole output a JSON object ``{"name": ..., "parameters": {...}}``
  (``arguments`` accepted too), optionally after ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``. ``[TOOL_CALLS]`` is a
  special token of Mistral's tokenizers, left out of the text by default (``skip_special_tokens``): the parser
  turns that off for requests that may call tools, as vLLM's does.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI reads PARSERS' names without loading the request types
    from pdserve.gateway.openai_protocol import ParsedRequest


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object

    def to_json(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(item: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments: Any = {}
    for key in arguments_keys:
        if key in item:
            arguments = item[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    name = ""
    # What opens the tool-call part of an output; text before it is content.
    markers: tuple[str, ...] = ()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The output's content (None when there is none but calls) and its calls, in order."""
        raise NotImplementedError

    def adjust_request(self, request: ParsedRequest) -> ParsedRequest:
        """``request`` as this parser needs it served (vLLM's ``ToolParser.adjust_request``); unchanged here."""
        return request


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[start:]):
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(body):
            try:
                item, end = decoder.raw_decode(body, position)
            except ValueError:
                return text, []
            call = _call(item, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            position = end
            rest = body[position:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            position = len(body) - len(rest)
        return None, calls


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def adjust_request(self, request: ParsedRequest) -> ParsedRequest:
        # The marker is a special token: the worker would leave it out of the text, and no call would be found.
        if request.tools is not None and request.tools.choice != "none":
            request.generate.sampling_params.skip_special_tokens = False
        return request

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len("[TOOL_CALLS]"):].strip())
        except ValueError:
            return text, []
        calls = [_call(item) for item in (items if isinstance(items, list) else [items])]
        if not calls or any(call is None for call in calls):
            return text, []
        content = text[:start].strip()
        return (content or None), [call for call in calls if call is not None]


PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser(name: str) -> ToolParser:
    """The parser ``--tool-call-parser`` names; ``ValueError`` listing the known ones."""
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known (known: {', '.join(sorted(PARSERS))})")
    return PARSERS[name]()


class ToolCallStream:
    """One streamed choice under ``tool_choice: "auto"``: text passes through until the parser's marker may
    start; from there the text is held, and parsed when the choice ends (``finish``)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = ""  # content already passed through
        self.held = ""  # text from the first possible marker on

    def feed(self, text: str) -> str:
        """The part of ``text`` (with what was held and turned out not to open a call) that is plain content
        for sure, to send now."""
        was_held = bool(self.held)
        pending, self.held = self.held + text, ""
        if was_held and self._opens_call(pending):
            self.held = pending
            return ""
        combined = self.sent + pending
        cut = self._possible_start(combined, len(self.sent))
        if cut is None:
            self.sent = combined
            return pending
        self.held = combined[cut:]
        out = combined[len(self.sent):cut]
        self.sent = combined[:cut]
        return out

    def _opens_call(self, held: str) -> bool:
        """Whether held text starts with a call's opening marker, or could still become one."""
        if isinstance(self.parser, Llama3JsonParser):
            return True  # held from the output's start: decided at the end
        return any(held.startswith(m) or m.startswith(held) for m in self.parser.markers)

    def _possible_start(self, text: str, first_new: int) -> int | None:
        """Where a marker starts in ``text`` (all the content so far), or may start (a marker's beginning at its
        end); searched from ``first_new`` back by a marker's length. llama3_json's markers only open an output."""
        if isinstance(self.parser, Llama3JsonParser):
            stripped = text.lstrip()
            if stripped and any(stripped.startswith(m) or m.startswith(stripped) for m in self.parser.markers):
                return len(text) - len(stripped)
            return None
        found = [index for marker in self.parser.markers
                 if (index := text.find(marker, max(0, first_new - len(marker) + 1))) >= 0]
        for marker in self.parser.markers:
            for length in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:length]):
                    found.append(len(text) - length)
                    break
        return min(found) if found else None

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the choice's end: the held text to send as content (when it held no calls) and the calls."""
        if not self.held:
            return "", []
        _, calls = self.parser.extract(self.sent + self.held)
        if not calls:
            return self.held, []
        # The content before the marker was sent already.
        return "", calls
