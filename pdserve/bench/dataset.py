"""The file workload: requests read from a JSON Lines dataset.

Each non-blank line is an object with exactly one of ``"prompt"`` (text,
tokenized by the server) and ``"prompt_token_ids"`` (a list of ids), and
optionally ``"output_len"`` (tokens to generate; default ``--output-len``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.bench.request import BenchRequest

ALLOWED_KEYS = frozenset({"prompt", "prompt_token_ids", "output_len"})


class DatasetError(ValueError):
    """A dataset line that is not a valid request; the message names the file and line."""


def load_dataset(path: Path, num_prompts: int, default_output_len: int) -> tuple[BenchRequest, ...]:
    """The first ``num_prompts`` requests of ``path``; every line up to them is checked."""
    requests: list[BenchRequest] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise DatasetError(f"cannot read dataset {path}: {error.strerror or error}") from error
    for number, line in enumerate(lines, start=1):
        if len(requests) == num_prompts:
            break
        if not line.strip():
            continue
        try:
            requests.append(parse_line(line, default_output_len))
        except ValueError as error:
            raise DatasetError(f"{path}:{number}: {error}") from error
    if len(requests) < num_prompts:
        raise DatasetError(f"{path} holds {len(requests)} requests, fewer than --num-prompts {num_prompts}")
    return tuple(requests)


def parse_line(line: str, default_output_len: int) -> BenchRequest:
    try:
        item: Any = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at column {error.colno})") from error
    if not isinstance(item, dict):
        raise ValueError(f"expected a JSON object, got {type(item).__name__}")
    unknown = sorted(set(item) - ALLOWED_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; allowed: {sorted(ALLOWED_KEYS)}")
    if ("prompt" in item) == ("prompt_token_ids" in item):
        raise ValueError('set exactly one of "prompt" and "prompt_token_ids"')
    output_len = item.get("output_len", default_output_len)
    if not _is_int(output_len) or output_len < 1:
        raise ValueError(f'"output_len" must be an integer >= 1, got {output_len!r}')
    if "prompt" in item:
        prompt = item["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'"prompt" must be a non-empty string, got {prompt!r:.60}')
        return BenchRequest(prompt_token_ids=None, prompt=prompt, output_len=output_len)
    ids = item["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f'"prompt_token_ids" must be a non-empty list of integers >= 0, got {ids!r:.60}')
    return BenchRequest(prompt_token_ids=tuple(ids), prompt=None, output_len=output_len)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a length
