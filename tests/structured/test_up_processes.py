"""Structured output, tool calls and reasoning through a real local cluster (the processes `pdserve up` starts:
a prefill and a decode worker, the gateway with its OpenAI HTTP API), with the official openai client."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import openai
import pydantic
import pytest

from tests.e2e.conftest import cluster_config, start_cluster  # noqa: F401 - start_cluster is a fixture
from tests.structured.test_tools import HERMES_CALL, SCHEMAS, TOOLS, TOOLS_TEMPLATE

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    population: int = pydantic.Field(ge=0, le=10_000_000)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.asyncio
async def test_json_tools_and_reasoning_through_the_processes_of_pdserve_up(
    chat_checkpoint: Path, tmp_path: Path, start_cluster  # noqa: F811 - the fixture
) -> None:
    from transformers import AutoTokenizer

    checkpoint = tmp_path / "tiny-llama-tools"
    shutil.copytree(chat_checkpoint, checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(checkpoint)
    http_port = _free_port()
    start_cluster(cluster_config(checkpoint, http_port=http_port, tool_call_parser="hermes",
                                 reasoning_parser="qwen3"))
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                                  max_retries=0) as client:
        parsed = await client.chat.completions.parse(model="m", messages=MESSAGES, response_format=City,  # type: ignore[arg-type]
                                                     max_tokens=200, temperature=0.0)
        assert parsed.choices[0].finish_reason == "stop" and isinstance(parsed.choices[0].message.parsed, City)

        named = await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0, seed=2,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        (call,) = named.choices[0].message.tool_calls or []
        assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
        assert set(json.loads(call.function.arguments)) == set(SCHEMAS["get_time"]["properties"])

        forced = {"structured_outputs": {"regex": r"<think>\nfirst [a-z]{2,5}\n</think>\n\n" + HERMES_CALL}}
        auto = await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=200,  # type: ignore[arg-type]
                                                    temperature=0.0, extra_body=forced)
        message = auto.choices[0].message
        assert auto.choices[0].finish_reason == "tool_calls" and message.content is None
        assert (message.model_extra or {})["reasoning_content"].startswith("first ")
        assert [c.function.name for c in message.tool_calls or []] == ["get_weather"]

        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                                                 extra_body={"guided_regex": "a(("})
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "guided_regex"
