"""The embedded default model (SmolLM2-135M-Instruct) through the engine: text in, text out."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(dtype="float32", num_kv_blocks=256)


def test_default_model_answers_the_capital_of_france_with_paris(default_llm: LLM) -> None:
    (out,) = default_llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0.0))
    assert out.prompt_token_ids == [504, 3575, 282, 4649, 314]
    assert out.token_ids[0] == 7042
    assert out.text.startswith(" Paris")


def test_stop_string_truncates_text_and_finishes(default_llm: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=["answer"])
    (out,) = default_llm.generate("The capital of France is", params)
    # Free-running greedy text is " Paris.\n\nThe answer is: ...".
    assert out.text == " Paris.\n\nThe "
    assert out.finish_reason == "stop"


def test_chat_template_reply_ends_on_the_end_of_turn_token(default_llm: LLM) -> None:
    (out,) = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                              SamplingParams(max_tokens=32, temperature=0.0))
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == 2  # <|im_end|>, the generation config's EOS
