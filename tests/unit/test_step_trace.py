"""``PDSERVE_STEP_TRACE_DIR``: a real engine writes one line per step it ran, with what it scheduled."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.step_trace import ENV, read_trace


def test_each_step_is_written_with_its_sequences_and_tokens(
    llama_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "steps"))
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64)
    (path,) = (tmp_path / "steps").glob("steps-*.jsonl")
    assert path == llm.engine.step_trace.path
    # Two prompts at once: one step prefills both (and samples their first tokens), then each
    # step decodes both, until the 5th token.
    llm.generate([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    steps = read_trace(path)
    assert [(s.seqs, s.tokens) for s in steps] == [(2, 10), (2, 2), (2, 2), (2, 2), (2, 2)]
    assert all(s.wall_s > 0 and s.cpu_s >= 0 for s in steps)
    assert [s.started for s in steps] == sorted(s.started for s in steps)
    assert all(later.started >= earlier.started + earlier.wall_s for earlier, later in zip(steps, steps[1:]))


def test_nothing_is_timed_or_written_without_the_variable(
    llama_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert llm.engine.step_trace is None
    assert list(tmp_path.iterdir()) == []
