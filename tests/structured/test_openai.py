"""Structured output through the public APIs: the official openai client against the gateway's HTTP API
(disaggregated and colocated), and the gRPC API; bad specs refused naming the field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Literal

import grpc
import jsonschema
import openai
import pydantic
import pytest

from pdserve.protos.pdserve.v1 import generation_pb2
from tests.structured.conftest import served

MESSAGES = [{"role": "user", "content": "Describe a person."}]


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    team: Literal["red", "blue"]


def _schema(index: int) -> dict[str, Any]:
    """A different bounded schema per index: its own field names, types and bounds."""
    kinds = [{"type": "integer", "minimum": 0, "maximum": 10 + index}, {"type": "string", "maxLength": 3 + index % 4},
             {"type": "boolean"}, {"enum": [f"v{index}", "w"]}]
    properties = {f"f{index}_{j}": kinds[(index + j) % 4] for j in range(1 + index % 3)}
    return {"type": "object", "properties": properties, "required": sorted(properties), "additionalProperties": False}


@pytest.mark.asyncio
@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
async def test_parse_json_object_and_a_streamed_schema_through_the_openai_client(chat_checkpoint: Path,
                                                                                  colocated: bool) -> None:
    async with served(chat_checkpoint, colocated) as (cluster, client):
        parsed = await client.chat.completions.parse(model="m", messages=MESSAGES, response_format=Person,  # type: ignore[arg-type]
                                                     max_tokens=200, temperature=0.0)
        choice = parsed.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
        assert choice.message.content == choice.message.parsed.model_dump_json()  # compact, in the schema's order

        anything = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=200,  # type: ignore[arg-type]
                                                        temperature=0.0, response_format={"type": "json_object"})
        assert anything.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)

        schema = Person.model_json_schema()
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=200, temperature=0.8, seed=3, stream=True,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
        chunks = [chunk async for chunk in stream]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
        assert chunks[-1].choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), schema)
        await cluster.wait_idle()


@pytest.mark.asyncio
async def test_regex_choice_and_grammar_through_extra_body_on_both_endpoints(chat_checkpoint: Path) -> None:
    async with served(chat_checkpoint) as (_, client):
        email = await client.completions.create(model="m", prompt="mail: ", max_tokens=60, temperature=0.0,
                                                extra_body={"structured_outputs": {"regex": r"[a-z]{3,6}@[a-z]{2,4}\.com"}})
        assert email.choices[0].finish_reason == "stop"
        assert __import__("re").fullmatch(r"[a-z]{3,6}@[a-z]{2,4}\.com", email.choices[0].text)
        old_name = await client.completions.create(model="m", prompt="mail: ", max_tokens=60, temperature=0.0,
                                                   extra_body={"guided_regex": r"[a-z]{3,6}@[a-z]{2,4}\.com"})
        assert old_name.choices[0].text == email.choices[0].text
        pick = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, temperature=0.0,  # type: ignore[arg-type]
                                                    extra_body={"guided_choice": ["sunny", "rainy", "windy"]})
        assert pick.choices[0].message.content in ("sunny", "rainy", "windy")
        assert pick.choices[0].finish_reason == "stop"
        grammar = 'start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/'
        sums = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=60, temperature=1.0,  # type: ignore[arg-type]
                                                    seed=1, n=3, extra_body={"structured_outputs": {"grammar": grammar}})
        for choice in sums.choices:
            assert choice.finish_reason == "stop"
            assert __import__("re").fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", choice.message.content or "")


@pytest.mark.asyncio
async def test_twelve_concurrent_requests_with_twelve_schemas_each_match_their_own(chat_checkpoint: Path) -> None:
    async with served(chat_checkpoint) as (cluster, client):
        schemas = [_schema(index) for index in range(12)]

        async def one(schema: dict[str, Any], seed: int) -> str:
            response = await client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=seed,  # type: ignore[arg-type]
                response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
            assert response.choices[0].finish_reason == "stop"
            return response.choices[0].message.content or ""

        texts = await asyncio.gather(*(one(schema, seed) for seed, schema in enumerate(schemas)))
        for text, schema in zip(texts, schemas):
            jsonschema.validate(json.loads(text), schema)
        await cluster.wait_idle()


@pytest.mark.asyncio
async def test_a_seeded_constrained_request_draws_the_same_tokens_with_and_without_disaggregation(
    chat_checkpoint: Path,
) -> None:
    body: dict[str, Any] = dict(model="m", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=11,
                                response_format={"type": "json_schema",
                                                 "json_schema": {"name": "p", "schema": Person.model_json_schema()}})
    texts = []
    for colocated in (False, True):
        async with served(chat_checkpoint, colocated) as (_, client):
            response = await client.chat.completions.create(**body)
            texts.append(response.choices[0].message.content)
    assert texts[0] == texts[1]
    Person.model_validate_json(texts[0] or "")


@pytest.mark.asyncio
async def test_bad_specs_are_400_naming_the_field_and_the_server_keeps_serving(chat_checkpoint: Path) -> None:
    refused: list[tuple[dict[str, Any], str]] = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema.schema"),
        (dict(response_format={"type": "yaml"}), "response_format.type"),
        (dict(extra_body={"guided_regex": "a(("}), "guided_regex"),
        (dict(extra_body={"structured_outputs": {"grammar": "start: nothing"}}), "structured_outputs.grammar"),
        (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs.choice"),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
        (dict(extra_body={"structured_outputs": {"whitespace_pattern": " "}}), "structured_outputs.whitespace_pattern"),
        (dict(extra_body={"guided_json": {"type": "object"}, "guided_regex": "a"}), "guided_regex"),
    ]
    async with served(chat_checkpoint) as (cluster, client):
        for args, param in refused:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, **args)  # type: ignore[arg-type]
            assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, args
        # gRPC: INVALID_ARGUMENT naming the field.
        request = generation_pb2.GenerateRequest(prompt="x", sampling_params=generation_pb2.SamplingParams(
            max_tokens=8, structured_outputs=generation_pb2.StructuredOutput(regex="a((")))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await cluster.generate(request)
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert failed.value.details().startswith("sampling_params.structured_outputs.regex does not compile")
        # Still serving, constrained or not.
        request = generation_pb2.GenerateRequest(prompt="x", sampling_params=generation_pb2.SamplingParams(
            max_tokens=8, temperature=0.0,
            structured_outputs=generation_pb2.StructuredOutput(choice=generation_pb2.Choices(choices=["yes", "no"]))))
        responses = await cluster.generate(request)
        assert "".join(r.text for r in responses) in ("yes", "no")
        assert responses[-1].finish_reason == generation_pb2.FINISH_REASON_STOP
        await cluster.wait_idle()
