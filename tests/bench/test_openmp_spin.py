"""``benchmarks.openmp_spin``: which cluster goes first each round, the summary, the CLI's bounds."""

from __future__ import annotations

import sys

import pytest

from benchmarks import openmp_spin
from benchmarks.openmp_spin import round_order, summarize


def test_the_settings_alternate_which_runs_first() -> None:
    assert [round_order(i) for i in range(3)] == [
        ("adaptive", "libgomp"),
        ("libgomp", "adaptive"),
        ("adaptive", "libgomp"),
    ]


def test_the_summary_pairs_rounds_and_takes_medians() -> None:
    summary = summarize({"adaptive": [120.0, 110.0, 90.0], "libgomp": [100.0, 100.0, 100.0]})
    assert summary["ratios"] == pytest.approx([1.2, 1.1, 0.9])
    assert summary["median_ratio"] == pytest.approx(1.1)
    assert summary["median_tokens_per_s"] == {"adaptive": 110.0, "libgomp": 100.0}
    with pytest.raises(ValueError):
        summarize({"adaptive": [1.0, 2.0], "libgomp": [1.0]})  # a round without its pair


def test_the_cli_refuses_fewer_than_one_round(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["openmp_spin", "--rounds", "0"])
    with pytest.raises(SystemExit) as exit_info:
        openmp_spin.main()  # refused before any cluster starts
    assert exit_info.value.code == 2
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
