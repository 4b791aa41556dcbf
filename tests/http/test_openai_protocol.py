"""OpenAI bodies to GenerateRequests, without a server: every parameter honoured or refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.gateway.openai_protocol import (
    CHAT_KEYS,
    COMPLETION_KEYS,
    NO_OP_VALUES,
    InvalidRequest,
    chat_messages,
    parse_chat,
    parse_completion,
)
from pdserve.protos.pdserve.v1 import generation_pb2


class RecordingTokenizer:
    """Stands in for a tokenizer: records the messages the chat template gets, returns fixed ids."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def apply_chat_template(self, messages: list[Any], **kwargs: Any) -> dict[str, list[int]]:
        self.messages.append(messages)
        return {"input_ids": [1, 2, 3]}


def _refused(parse: Any, body: dict[str, Any], param: str, text: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    assert caught.value.param == param
    assert text in str(caught.value)


def _completion(**body: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": [1, 2, 3], **body}


def _chat(**body: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}


def test_every_sampling_parameter_lands_in_its_proto_field() -> None:
    body = _completion(max_tokens=9, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop=["x"], stop_token_ids=[7, 9],
                       ignore_eos=True, min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.25,
                       repetition_penalty=1.2, logit_bias={"5": -100, "17": 2.5}, logprobs=3, prompt_logprobs=1)
    parsed = parse_completion(body)
    assert parsed.generate.sampling_params == generation_pb2.SamplingParams(
        max_tokens=9, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop=["x"], stop_token_ids=[7, 9],
        ignore_eos=True, min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
        logit_bias={5: -100.0, 17: 2.5}, logprobs=3, prompt_logprobs=1)
    assert (parsed.n, parsed.logprobs, parsed.logprobs_count, parsed.echo, parsed.prompt_logprobs) == (1, True, 3, False, 1)
    chat = parse_chat(_chat(max_completion_tokens=4, logprobs=True, top_logprobs=2, presence_penalty=1.0),
                      RecordingTokenizer())
    assert chat.generate == generation_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3],
        sampling_params=generation_pb2.SamplingParams(max_tokens=4, logprobs=2, presence_penalty=1.0))


def test_echo_with_logprobs_asks_for_the_prompts_logprobs() -> None:
    parsed = parse_completion(_completion(echo=True, logprobs=2, max_tokens=1))
    assert parsed.generate.sampling_params.prompt_logprobs == 2
    assert (parsed.echo, parsed.prompt_logprobs) == (True, None)  # vLLM's own field is not returned
    assert not parse_completion(_completion(echo=True)).generate.sampling_params.HasField("prompt_logprobs")
    both = parse_completion(_completion(echo=True, logprobs=1, prompt_logprobs=4))
    assert (both.generate.sampling_params.prompt_logprobs, both.prompt_logprobs) == (4, 4)


def test_n_choices_get_seed_plus_index_and_only_the_first_computes_prompt_logprobs() -> None:
    parsed = parse_completion(_completion(n=3, best_of=3, seed=10, prompt_logprobs=0, temperature=1.0))
    requests = parsed.choice_requests()
    assert [r.sampling_params.seed for r in requests] == [10, 11, 12]
    assert [r.sampling_params.HasField("prompt_logprobs") for r in requests] == [True, False, False]
    assert all(list(r.prompt_token_ids) == [1, 2, 3] for r in requests)
    unseeded = parse_completion(_completion(n=2)).choice_requests()
    assert [r.sampling_params.HasField("seed") for r in unseeded] == [False, False]
    _refused(parse_completion, _completion(n=17), "n", "n must be in [1, 16]")
    _refused(lambda b: parse_completion(b, max_n=4), _completion(n=5), "n", "n must be in [1, 4]")
    _refused(parse_completion, _completion(n=0), "n", "got 0")
    _refused(parse_completion, _completion(n=2, best_of=3), "best_of", "best_of must equal n (2)")


def test_content_parts_and_developer_messages_reach_the_template_as_text() -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "system", "content": "And kind."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
    ]
    assert chat_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "And kind."},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": "ok"},
        {"role": "assistant", "content": "I can't."},
    ]


@pytest.mark.parametrize("messages, param, text", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role", "must be one of system, developer, user, assistant, tool"),
    ([{"role": "user", "content": "hi"}, {"role": "function", "content": "42"}], "messages[1].role",
     "deprecated name: use 'tool'"),
    ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id", "must be a string, got None"),
    ([{"role": "user", "content": "hi", "tool_call_id": "x"}], "messages[0].tool_call_id", "not supported in a user"),
    ([{"content": "hi"}], "messages[0].role", "got None"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}],
     "messages[1].content[0].type", "'image_url' is not supported"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}]}],
     "messages[0].content[1].type", "'input_audio'"),
    ([{"role": "user", "content": [{"type": "file", "file": {}}]}], "messages[0].content[0].type", "'file'"),
    ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}], "messages[0].content[0].type",
     "'refusal' is not supported"),
    ([{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}], "messages[0].content[0].text",
     "not supported in a refusal part"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "must be a string, got None"),
    ([{"role": "user", "content": [{"type": "text", "text": "a", "detail": 1}]}], "messages[0].content[0].detail",
     "not supported"),
    ([{"role": "user", "content": []}], "messages[0].content", "non-empty list"),
    ([{"role": "user", "content": None}], "messages[0].content", "string or a non-empty list"),
    ([{"role": "assistant", "content": "x", "tool_calls": {}}], "messages[0].tool_calls", "must be a list"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}],
     "messages[0].tool_calls[0].function.arguments", "JSON object's text"),
    ([{"role": "user", "content": "x", "name": 3}], "messages[0].name", "must be a string"),
    ([], "messages", "non-empty list"),
])
def test_messages_pdserve_cannot_serve_are_refused_by_path(messages: list[Any], param: str, text: str) -> None:
    _refused(lambda b: parse_chat(b, RecordingTokenizer()), {"messages": messages}, param, text)


def test_unknown_keys_are_refused_by_name() -> None:
    _refused(parse_completion, _completion(min_p=0.1), "min_p", "unknown parameter: min_p")
    _refused(parse_completion, _completion(zeta=1, alpha=2), "alpha", "unknown parameters: alpha, zeta")
    # Chat-only keys are unknown to completions, and the other way round.
    _refused(parse_completion, _completion(top_logprobs=2), "top_logprobs", "unknown parameter")
    _refused(lambda b: parse_chat(b, RecordingTokenizer()), _chat(echo=True), "echo", "unknown parameter")
    _refused(lambda b: parse_chat(b, RecordingTokenizer()), _chat(suffix=""), "suffix", "unknown parameter")
    _refused(parse_completion, _completion(stream=True, stream_options={"include_usage": True, "x": 1}),
             "stream_options.x", "unknown stream option")


ACCEPTED = [
    ("user", "u-1"), ("safety_identifier", "s"), ("prompt_cache_key", "k"), ("metadata", {"a": "b"}),
    ("store", False), ("modalities", ["text"]),
    ("functions", []), ("function_call", "none"),
    ("service_tier", "auto"), ("service_tier", "default"), ("prompt_cache_retention", "in_memory"), ("audio", None),
]
REFUSED = [
    ("user", 5), ("metadata", {"a": 1}), ("store", True), ("modalities", ["text", "audio"]),
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("service_tier", "flex"), ("prompt_cache_retention", "24h"), ("audio", {"voice": "alloy", "format": "mp3"}),
    ("moderation", {}), ("prediction", {"type": "content", "content": "x"}), ("prompt_cache_options", {}),
    ("reasoning_effort", "low"), ("verbosity", "low"), ("web_search_options", {}),
]


def test_the_no_op_table_covers_only_known_keys() -> None:
    assert set(NO_OP_VALUES) <= CHAT_KEYS | COMPLETION_KEYS
    assert {name for name, _ in ACCEPTED + REFUSED} == set(NO_OP_VALUES) - {"suffix"}


@pytest.mark.parametrize("name, value", ACCEPTED)
def test_values_that_change_nothing_are_accepted(name: str, value: Any) -> None:
    parsed = parse_chat(_chat(**{name: value}), RecordingTokenizer())
    assert parsed.generate.sampling_params == generation_pb2.SamplingParams()


@pytest.mark.parametrize("name, value", REFUSED)
def test_values_that_would_change_the_output_are_refused_by_name(name: str, value: Any) -> None:
    _refused(lambda b: parse_chat(b, RecordingTokenizer()), _chat(**{name: value}), name, f"{name} may only be")


def test_suffix_and_type_and_range_errors_name_the_field() -> None:
    assert parse_completion(_completion(suffix="")).n == 1
    _refused(parse_completion, _completion(suffix="end"), "suffix", 'suffix may only be ""')
    _refused(parse_completion, _completion(max_tokens=2**40), "max_tokens", "out of range")
    _refused(parse_completion, _completion(seed=2**70), "seed", "out of range")
    _refused(parse_completion, _completion(top_k=True), "top_k", "must be an integer")
    _refused(parse_completion, _completion(presence_penalty="1"), "presence_penalty", "must be a number")
    _refused(parse_completion, _completion(logit_bias={"x": 1}), "logit_bias", "keys must be token ids")
    _refused(parse_completion, _completion(logit_bias={"-1": 1}), "logit_bias", "keys must be token ids")
    _refused(parse_completion, _completion(logit_bias={"5": "high"}), "logit_bias", "must be a number")
    _refused(parse_completion, _completion(logit_bias=[1]), "logit_bias", "must be an object")
    _refused(parse_completion, _completion(stop_token_ids=[-1]), "stop_token_ids", "integers >= 0")
    _refused(parse_completion, _completion(stop_token_ids=[2**33]), "stop_token_ids", "out of range")
    _refused(parse_completion, _completion(prompt=[2**33]), "prompt", "out of range")
    _refused(parse_completion, _completion(stream_options={"include_usage": True}), "stream_options", "stream: true")
    _refused(parse_completion, _completion(stream=True, stream_options={"continuous_usage_stats": 1}),
             "stream_options.continuous_usage_stats", "must be a boolean")
    _refused(lambda b: parse_chat(b, RecordingTokenizer()), _chat(max_tokens=3, max_completion_tokens=4),
             "max_tokens", "not both")
    _refused(lambda b: parse_chat(b, RecordingTokenizer()), _chat(model=3), "model", "must be a string")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, generation_pb2.StructuredOutput(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"},
                                                                      "strict": True}}},
         generation_pb2.StructuredOutput(json='{"type": "object"}')),
        ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": False}},
         generation_pb2.StructuredOutput(regex="[0-9]+", disable_any_whitespace=False)),
        ({"guided_choice": ["a", "b"]}, generation_pb2.StructuredOutput(choice=generation_pb2.Choices(choices=["a", "b"]))),
        ({"guided_json": {"type": "array"}}, generation_pb2.StructuredOutput(json='{"type": "array"}')),
        ({"guided_grammar": 'start: "x"'}, generation_pb2.StructuredOutput(grammar='start: "x"')),
        ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                              "triggers": ["<f"]}},
         generation_pb2.StructuredOutput(structural_tag='{"type": "structural_tag", "structures": [{"begin": "<f>", '
                                                        '"schema": {}, "end": "</f>"}], "triggers": ["<f"]}')),
    ],
)
def test_response_format_structured_outputs_and_guided_fields_become_the_requests_structured_output(
    extra: dict[str, Any], expected: generation_pb2.StructuredOutput | None
) -> None:
    for parsed in (parse_chat(_chat(**extra), RecordingTokenizer()), parse_completion({"prompt": "x", **extra})):
        params = parsed.generate.sampling_params
        if expected is None:
            assert not params.HasField("structured_outputs")
            continue
        if not expected.HasField("disable_any_whitespace"):
            expected.disable_any_whitespace = True
        assert params.structured_outputs == expected
