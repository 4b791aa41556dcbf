"""The file workload: both prompt forms, and bad lines refused with their line number."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.bench.dataset import DatasetError, load_dataset
from pdserve.bench.request import BenchRequest
from pdserve.bench.workload import WorkloadConfig, build_workload


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_both_prompt_forms_are_read_and_blank_lines_skipped(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        '{"prompt": "Hello there", "output_len": 12}',
        "",
        '{"prompt_token_ids": [20, 21, 22], "output_len": 3}',
        '{"prompt_token_ids": [5]}',
    ])
    assert load_dataset(path, 3, default_output_len=9) == (
        BenchRequest(prompt_token_ids=None, prompt="Hello there", output_len=12),
        BenchRequest(prompt_token_ids=(20, 21, 22), prompt=None, output_len=3),
        BenchRequest(prompt_token_ids=(5,), prompt=None, output_len=9),  # no output_len: --output-len
    )


def test_only_the_first_num_prompts_requests_are_read(tmp_path: Path) -> None:
    path = _write(tmp_path, ['{"prompt": "a"}', '{"prompt": "b"}', "this line is never read"])
    assert [r.prompt for r in load_dataset(path, 2, default_output_len=1)] == ["a", "b"]


def test_the_file_workload_builds_from_the_dataset(tmp_path: Path) -> None:
    path = _write(tmp_path, ['{"prompt_token_ids": [30, 31], "output_len": 2}'])
    config = WorkloadConfig(kind="file", num_prompts=1, dataset=path)
    expected = (BenchRequest(prompt_token_ids=(30, 31), prompt=None, output_len=2),)
    assert build_workload(config, vocab_size=512) == expected


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"prompt": "a", "prompt_token_ids": [1]}', 'exactly one of "prompt" and "prompt_token_ids"'),
    ('{"output_len": 3}', 'exactly one of "prompt" and "prompt_token_ids"'),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"prompt_token_ids": []}', '"prompt_token_ids" must be a non-empty list of integers >= 0'),
    ('{"prompt_token_ids": [1, -2]}', '"prompt_token_ids" must be a non-empty list of integers >= 0'),
    ('{"prompt_token_ids": [1, 2.5]}', '"prompt_token_ids" must be a non-empty list of integers >= 0'),
    ('{"prompt": "a", "output_len": 0}', '"output_len" must be an integer >= 1, got 0'),
    ('{"prompt": "a", "output_len": true}', '"output_len" must be an integer >= 1, got True'),
    ('{"prompt": "a", "max_tokens": 3}', "unknown keys \\['max_tokens'\\]"),
])
def test_a_bad_line_is_refused_naming_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, ['{"prompt": "fine"}', "", line])
    with pytest.raises(DatasetError, match=f"^{re.escape(str(path))}:3: .*{message}"):
        load_dataset(path, 2, default_output_len=4)


def test_too_few_requests_and_a_missing_file_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, ['{"prompt": "only one"}'])
    with pytest.raises(DatasetError, match=f"{re.escape(str(path))} holds 1 requests, fewer than --num-prompts 2"):
        load_dataset(path, 2, default_output_len=4)
    with pytest.raises(DatasetError, match="cannot read dataset"):
        load_dataset(tmp_path / "missing.jsonl", 1, default_output_len=4)
