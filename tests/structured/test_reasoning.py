"""Reasoning output: the <think> part apart from the answer (whole and streamed, cut anywhere), the grammar that
starts after the thinking, and reasoning_content through the official openai client."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.structured_output import GrammarCompiler, RequestGrammar, build_tokenizer
from pdserve.engine.types.structured_outputs import StructuredOutputsParams
from pdserve.gateway.openai_protocol import parse_chat
from pdserve.gateway.reasoning_parsers import ReasoningStream, reasoning_parser
from pdserve.gateway.tokenizer import load_tokenizer
from tests.conftest import VOCAB_SIZE
from tests.structured.conftest import served

OUTPUTS = ["I think.\n</think>\n\nAnswer!", "<think>\nhmm\n</think>\n\n{\"a\":1}", "still thinking", "Plain answer",
           "\n<think>x</think>y", "<thi", "<think>"]
# (parser, the output begins inside the thinking) -> each output's (reasoning, answer)
SPLITS = {
    ("deepseek_r1", True): [("I think.", "Answer!"), ("hmm", '{"a":1}'), ("still thinking", None), ("Plain answer", None),
                            ("x", "y"), ("<thi", None), (None, None)],
    ("qwen3", False): [(None, "I think.\n</think>\n\nAnswer!"), ("hmm", '{"a":1}'), (None, "still thinking"),
                       (None, "Plain answer"), ("x", "y"), (None, "<thi"), (None, None)],
    ("qwen3", True): [("I think.", "Answer!"), ("hmm", '{"a":1}'), ("still thinking", None), ("Plain answer", None),
                      ("x", "y"), ("<thi", None), (None, None)],
}


@pytest.mark.parametrize(("name", "inside"), list(SPLITS))
def test_whole_and_streamed_outputs_split_alike_wherever_the_stream_is_cut(name: str, inside: bool) -> None:
    parser = reasoning_parser(name)
    assert [parser.split(text, inside) for text in OUTPUTS] == SPLITS[name, inside]
    for text, expected in zip(OUTPUTS, SPLITS[name, inside]):
        for size in (1, 2, 3, 7, len(text) or 1):
            stream = ReasoningStream(parser, inside)
            reasoning = answer = ""
            for start in range(0, len(text), size):
                piece = stream.feed(text[start : start + size])
                reasoning, answer = reasoning + piece[0], answer + piece[1]
            rest = stream.finish()
            reasoning, answer = reasoning + rest[0], answer + rest[1]
            assert (reasoning.strip("\n") or None, answer or None) == expected, (text, size)


def test_the_prompt_says_whether_the_output_begins_inside_the_thinking() -> None:
    qwen3, r1 = reasoning_parser("qwen3"), reasoning_parser("deepseek_r1")
    assert qwen3.thinks_from_start("<|im_start|>assistant\n<think>\n")
    assert not qwen3.thinks_from_start("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not qwen3.thinks_from_start("<|im_start|>assistant\n")
    assert r1.thinks_from_start("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        reasoning_parser("o1")


def test_a_grammar_after_the_thinking_starts_at_the_first_end_marker(chat_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    compiler = GrammarCompiler(lambda: build_tokenizer(tokenizer, VOCAB_SIZE, {7}))
    spec = StructuredOutputsParams(regex="[0-9]{2}", reasoning_end="</think>")
    compiled: Future[Any] = Future()
    compiled.set_result(compiler.compile(spec))
    marker = tuple(tokenizer("</think>", add_special_tokens=False)["input_ids"])
    grammar = RequestGrammar(spec, compiled, marker)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert grammar.matcher(ids("free text, not json")) is None and grammar.error is None
    assert grammar.advance(ids("x")[0]) is False  # free tokens before the marker
    matcher = grammar.matcher(ids("a < b</think>4"))  # the "4" after the marker is the grammar's first
    assert matcher is not None and grammar.error is None
    assert grammar.advance(ids("2")[0]) is True and grammar.error is None  # "42": the grammar is complete
    refused = RequestGrammar(spec, compiled, marker)
    assert refused.matcher(ids("</think>x")) is None and refused.error is not None


def _template(opening: str) -> str:
    return ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n" + opening + "{% endif %}")


@pytest.fixture(scope="module")
def thinking_llamas(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two copies of the chat Llama: one whose template opens <think> for the model (R1's way), one that does not."""
    from transformers import AutoTokenizer

    folders = {}
    for name, opening in (("opens", "<think>\n"), ("plain", "")):
        directory = tmp_path_factory.mktemp(f"tiny-llama-{name}")
        for path in chat_checkpoint.iterdir():
            shutil.copy(path, directory / path.name)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        tokenizer.chat_template = _template(opening)
        tokenizer.save_pretrained(directory)
        folders[name] = directory
    return folders


def test_structured_output_waits_for_the_thinking_where_the_template_opened_it(
    thinking_llamas: dict[str, Path],
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    opened = parse_chat(body, load_tokenizer(str(thinking_llamas["opens"])), reasoning=reasoning_parser("qwen3"))
    plain = parse_chat(body, load_tokenizer(str(thinking_llamas["plain"])), reasoning=reasoning_parser("qwen3"))
    assert (opened.starts_thinking, opened.generate.sampling_params.structured_outputs.reasoning_end) == (True,
                                                                                                       "</think>")
    assert (plain.starts_thinking, plain.generate.sampling_params.structured_outputs.reasoning_end) == (False, "")
    without = parse_chat(body, load_tokenizer(str(thinking_llamas["plain"])))
    assert without.starts_thinking is None


@pytest.mark.asyncio
async def test_reasoning_content_apart_from_the_answer_streamed_and_not(thinking_llamas: dict[str, Path]) -> None:
    # The tiny random model does not think on its own: a regex makes it write a think block, then a JSON answer.
    shaped = {"structured_outputs": {"regex": r'<think>\n[a-z]{3,8}( [a-z]{2,6}){1,3}\n</think>\n\n\{"n": [0-9]{1,2}\}'}}
    messages = [{"role": "user", "content": "Think, then answer."}]
    async with served(thinking_llamas["plain"], reasoning_parser="qwen3") as (_, client):
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=120,  # type: ignore[arg-type]
                                                     temperature=0.0, extra_body=shaped)
        message = reply.choices[0].message
        reasoning = message.model_extra["reasoning_content"]  # type: ignore[index]
        assert reply.choices[0].finish_reason == "stop"
        assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
        assert json.loads(message.content or "")["n"] >= 0
        stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=120,  # type: ignore[arg-type]
                                                      temperature=0.0, extra_body=shaped, stream=True)
        thought, content = "", ""
        async for chunk in stream:
            if chunk.choices:
                delta = chunk.choices[0].delta
                thought += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
        assert (thought.strip("\n"), content) == (reasoning, message.content)
