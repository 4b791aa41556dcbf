"""``pdserve bench`` options: rates, sweeps and SLOs parsed, bad ones refused with a usable message."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from pdserve.bench import add_bench_arguments
from pdserve.bench.cli import config_from_args
from pdserve.bench.config import parse_rates, parse_slos, rate_label
from pdserve.bench.metrics import SLOs


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench")
    add_bench_arguments(parser)
    return parser.parse_args(argv)


def test_goodput_slos_take_any_subset() -> None:
    assert parse_slos(["ttft:500", "e2el:2000.5"]) == SLOs(ttft_ms=500, e2el_ms=2000.5)
    assert parse_slos(["tpot:50"]) == SLOs(tpot_ms=50)
    assert parse_slos([]) == SLOs()
    assert not SLOs().is_set


@pytest.mark.parametrize(("items", "message"), [
    (["ttfb:5"], "KEY one of ttft, tpot, e2el, got 'ttfb:5'"),
    (["ttft"], "KEY one of ttft, tpot, e2el"),
    (["ttft:5", "ttft:6"], "gives ttft twice"),
    (["tpot:fast"], "tpot needs a number of milliseconds, got 'fast'"),
    (["e2el:-1"], "e2el SLO must be a positive number"),
])
def test_bad_slos_are_refused(items: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_slos(items)


def test_sweeps_parse_in_order_with_inf() -> None:
    assert parse_rates("1, 2.5,inf") == (1.0, 2.5, math.inf)
    assert [rate_label(r) for r in parse_rates("1,2.5,inf")] == ["1", "2.5", "inf"]
    with pytest.raises(ValueError, match="comma-separated rates"):
        parse_rates("1,,2")
    with pytest.raises(ValueError, match="must be positive"):
        parse_rates("1,0")


def test_arguments_become_the_benchmark_configuration(tmp_path: Path) -> None:
    args = _parse("--target", "10.0.0.1:5", "--workload", "prefix", "--num-prompts", "8", "--input-len", "16",
                  "--output-len", "8", "--num-prefixes", "2", "--prefix-len", "32", "--seed", "3",
                  "--sweep", "2,inf", "--burstiness", "0.5", "--max-concurrency", "4", "--warmup", "2",
                  "--ignore-eos", "--goodput", "ttft:100", "tpot:20", "--result-json", str(tmp_path / "r.json"),
                  "--disable-tqdm")
    config = config_from_args(args)
    assert (config.target, config.request_rates, config.burstiness, config.max_concurrency, config.warmup) == (
        "10.0.0.1:5", (2.0, math.inf), 0.5, 4, 2)
    assert (config.workload.kind, config.workload.num_prompts, config.workload.prefix_len, config.workload.seed) == (
        "prefix", 8, 32, 3)
    assert config.slos == SLOs(ttft_ms=100, tpot_ms=20)
    assert (config.sampling.ignore_eos, config.sampling.temperature, config.show_progress) == (True, 0.0, False)
    assert (config.result_json, config.plot_dir) == (tmp_path / "r.json", None)
    run = config.run_config(2.0, "bench-x-0")
    assert (run.request_rate, run.burstiness, run.max_concurrency, run.seed, run.request_id_prefix) == (
        2.0, 0.5, 4, 3, "bench-x-0")


def test_the_default_rate_is_infinite_and_a_bad_rate_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_from_args(_parse()).request_rates == (math.inf,)
    with pytest.raises(SystemExit):
        _parse("--request-rate", "-3")
    assert "a request rate must be positive (or inf), got '-3'" in capsys.readouterr().err
