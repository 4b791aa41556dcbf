"""Reasoning models' thinking apart from their answer (vLLM's ``--reasoning-parser`` names).

Both parsers read the ``<think>...</think>`` convention:

- ``deepseek_r1``: DeepSeek-R1's template opens ``<think>`` in the prompt, so the output starts inside the
  thinking: everything up to ``</think>`` is reasoning (an opening ``<think>`` the model writes itself is
  dropped), the rest the answer; an output with no ``</think>`` is all reasoning (cut short while thinking).
- ``qwen3``: Qwen3 thinks when it writes ``<think>`` first (its template may also put it in the prompt: then
  ``</think>`` alone marks the end); an output with neither is all answer (thinking switched off).

``ReasoningStream`` splits a streamed output the same way, holding back text that may be the start of a
marker until it is known.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    # The output begins inside the thinking, whatever it starts with.
    starts_thinking = False

    def thinks_from_start(self, prompt_text: str) -> bool:
        """Whether a request's output begins inside the thinking: always for DeepSeek-R1; for others when the
        prompt leaves a ``<think>`` open (a template that opens it for the model)."""
        return self.starts_thinking or prompt_text.rfind(START) > prompt_text.rfind(END)

    def split(self, text: str, starts_thinking: bool | None = None) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output; None where a part is absent. ``starts_thinking``: the output
        begins inside the thinking (default: the parser's own rule)."""
        inside = self.starts_thinking if starts_thinking is None else starts_thinking
        body = text.lstrip()
        opened = body.startswith(START)
        if opened:
            body = body[len(START):]
        elif not inside:
            return None, text or None
        end = body.find(END)
        if end < 0:
            return body.strip("\n") or None, None
        reasoning, answer = body[:end], body[end + len(END):].lstrip("\n")
        return reasoning.strip("\n") or None, answer or None


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_thinking = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


PARSERS: dict[str, type[ReasoningParser]] = {cls.name: cls for cls in (DeepSeekR1Parser, Qwen3Parser)}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser ``--reasoning-parser`` names; ``ValueError`` listing the known ones."""
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not known (known: {', '.join(sorted(PARSERS))})")
    return PARSERS[name]()


class ReasoningStream:
    """One streamed choice: each piece of output becomes (reasoning, answer) text to send now, as ``split``
    would cut the whole."""

    def __init__(self, parser: ReasoningParser, starts_thinking: bool | None = None) -> None:
        inside = parser.starts_thinking if starts_thinking is None else starts_thinking
        # "start": the output's opening is still to be read (an opening <think>?); then "thinking" or "answer".
        self.phase = "start"
        self.inside = inside
        self.held = ""
        # The answer's first text is still to come after </think> (whose following newlines are dropped).
        self.after_think = False

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning, answer = "", ""
        while self.held:
            if self.phase == "start":
                body = self.held.lstrip()
                if not body or (START.startswith(body) and body != START):
                    return reasoning, answer  # whitespace, or what may still become <think>
                if body.startswith(START):
                    self.held, self.phase = body[len(START):], "thinking"
                elif self.inside:
                    self.held, self.phase = body, "thinking"
                else:
                    self.phase = "answer"
                continue
            if self.phase == "thinking":
                end = self.held.find(END)
                if end >= 0:
                    reasoning += self.held[:end]
                    self.held, self.phase, self.after_think = self.held[end + len(END):], "answer", True
                    continue
                keep = _partial_suffix(self.held, END)
                reasoning += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return reasoning, answer
            # answer: the newlines right after </think> are not part of it
            if self.after_think:
                self.held = self.held.lstrip("\n")
                if not self.held:
                    return reasoning, answer
                self.after_think = False
            answer += self.held
            self.held = ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is still held when the choice ends."""
        held, self.held = self.held, ""
        if self.phase == "thinking" or (self.phase == "start" and self.inside):
            return held, ""
        if self.phase == "start":
            return "", held
        return "", held.lstrip("\n") if self.after_think else held


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0: none)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
