"""What a request's output must match (vLLM's ``StructuredOutputsParams``), checked where it is built.

A value type: torch- and llguidance-free, so the gateway and the services check
a request's fields with it. Turning a spec into a grammar and a token mask is
``pdserve.engine.structured_output``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# The kinds a request may ask for, in vLLM's StructuredOutputsParams' names.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class GrammarError(ValueError):
    """A structured-output spec that does not compile; the message names the field."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What one request's output must match: exactly one of ``json`` (a JSON schema, as a dict or its
    text), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark or GBNF, as llguidance reads them)
    and ``json_object=True`` (any JSON object). ``disable_any_whitespace`` (vLLM's name; default True here)
    generates JSON with compact separators and no whitespace between tokens; False allows at most
    ``MAX_WHITESPACE_RUN`` whitespace characters in a row.

    ``structural_tag`` (vLLM's, as a dict or its JSON text): free text in which each ``trigger`` opens one of the
    ``structures``, ``begin``, then JSON matching its ``schema``, then ``end``:
    ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = True
    # Reasoning models: the grammar holds the output only after this text (its tokens, as the model's tokenizer
    # writes them, e.g. "</think>"); the thinking before it is free. None: from the first token.
    reasoning_end: str | None = None
    # The request field that holds the spec's value, for error messages ("response_format.json_schema.schema",
    # "guided_regex"...); empty: "structured_outputs.<kind>".
    field_name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "structural_tag"):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, json.dumps(getattr(self, name)))
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise GrammarError(
                f"{self.field_name or 'structured_outputs'}: set exactly one of {', '.join(KINDS)}; got "
                + (", ".join(given) if given else "none")
            )
        kind = given[0]
        value = getattr(self, kind)
        where = self.where
        if kind in ("json", "regex", "grammar", "structural_tag") and (not isinstance(value, str) or not value):
            raise GrammarError(f"{where} must be a non-empty string, got {value!r}")
        if kind == "json":
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as error:
                raise GrammarError(f"{where} is not valid JSON: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"{where} must be a JSON schema (an object), got {type(schema).__name__}")
        if kind == "choice":
            if isinstance(value, str) or not value or not all(isinstance(c, str) and c for c in value):
                raise GrammarError(f"{where} must be a non-empty list of non-empty strings, got {value!r}")
        if kind == "structural_tag":
            structural_tag_structures(value, where)  # checked here: GrammarError naming the field
        if kind == "json_object" and value is not True:
            raise GrammarError(f"{where} must be true, got {value!r}")
        if self.reasoning_end is not None and (not isinstance(self.reasoning_end, str) or not self.reasoning_end):
            raise GrammarError(f"reasoning_end must be a non-empty string or None, got {self.reasoning_end!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise GrammarError(f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")

    @property
    def where(self) -> str:
        """The request field errors name."""
        return self.field_name or f"structured_outputs.{self.kind}"

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compile cache is keyed by: the kind, its text, the whitespace setting."""
        value = getattr(self, self.kind)
        text = json.dumps(list(value)) if self.kind == "choice" else str(value)
        return self.kind, text, self.disable_any_whitespace


class StructuralTagStructure(NamedTuple):
    """One structure of a structural tag: text that opens with ``begin`` (which starts with ``trigger``), then
    JSON matching ``schema`` (its text), then ``end``."""

    trigger: str
    begin: str
    schema: str
    end: str


def structural_tag_structures(text: str, where: str) -> list[StructuralTagStructure]:
    """vLLM's structural tag (JSON text) checked: each structure with the trigger its ``begin`` starts with.
    ``GrammarError`` naming what is wrong (``where``: the request field)."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as error:
        raise GrammarError(f"{where} is not valid JSON: {error}") from None
    if not isinstance(tag, dict) or tag.get("type", "structural_tag") != "structural_tag":
        raise GrammarError(f'{where} must be {{"type": "structural_tag", "structures": [...], "triggers": [...]}}')
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise GrammarError(f"{where}.structures must be a non-empty list of {{begin, schema, end}}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError(f"{where}.triggers must be a non-empty list of non-empty strings")
    tags = []
    for index, structure in enumerate(structures):
        at = f"{where}.structures[{index}]"
        if not isinstance(structure, dict) or not isinstance(structure.get("begin"), str) \
                or not isinstance(structure.get("end", ""), str):
            raise GrammarError(f"{at} must hold begin and end strings and a schema")
        schema = structure.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{at}.schema must be a JSON schema (an object)")
        trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"{at}.begin {structure['begin']!r} starts with none of the triggers {triggers}")
        tags.append(StructuralTagStructure(trigger, structure["begin"], json.dumps(schema), structure.get("end", "")))
    return tags
