"""``pdserve bench`` against a real local cluster (tiny random model, token-id prompts)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench import add_bench_arguments, run_bench
from pdserve.launcher import LocalCluster
from tests.e2e.conftest import cluster_config

METRIC_KEYS = {
    "duration_s", "completed", "failed", "errors_by_code", "first_errors", "total_prompt_tokens",
    "total_output_tokens", "total_cached_prompt_tokens", "request_throughput", "output_throughput",
    "total_token_throughput", "prefix_cache_hit_rate", "good_requests", "goodput", "ttft", "tpot", "itl", "e2el",
    "spec_decode_acceptance_rate", "spec_decode_mean_accepted_length",
}
STATS_KEYS = {"count", "mean_ms", "median_ms", "p90_ms", "p99_ms"}


@pytest.fixture(scope="module")
def endpoint(llama_checkpoint: Path) -> Iterator[str]:
    # No Redis: one prefill and one decode worker need no registry, and nothing is left behind in Redis.
    with LocalCluster(cluster_config(llama_checkpoint, redis_url=None)) as cluster:
        yield cluster.endpoint


def _bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench")
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


def test_a_run_reports_every_metric_and_writes_json_and_plots(
    endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result_path, plot_dir = tmp_path / "result.json", tmp_path / "plots"
    status = _bench("--target", endpoint, "--num-prompts", "8", "--request-rate", "20", "--input-len", "32",
                    "--output-len", "8", "--ignore-eos", "--seed", "1", "--warmup", "2",
                    "--goodput", "ttft:60000", "tpot:60000", "e2el:60000",
                    "--result-json", str(result_path), "--plot-dir", str(plot_dir))
    captured = capsys.readouterr()
    assert status == 0
    assert "Serving Benchmark Result" in captured.out and "P99 ITL (ms):" in captured.out
    assert "8/8" in captured.err  # the progress bar, on stderr

    document = json.loads(result_path.read_text())
    assert document["config"]["request_rates"] == [20.0]
    assert document["model"]["vocab_size"] == 512
    (run,) = document["runs"]
    metrics = run["metrics"]
    assert set(metrics) == METRIC_KEYS
    assert all(set(metrics[name]) == STATS_KEYS for name in ("ttft", "tpot", "itl", "e2el"))
    assert (metrics["completed"], metrics["failed"], metrics["errors_by_code"]) == (8, 0, {})
    assert (metrics["total_prompt_tokens"], metrics["total_output_tokens"]) == (256, 64)
    assert metrics["good_requests"] == 8
    assert (metrics["ttft"]["count"], metrics["tpot"]["count"], metrics["e2el"]["count"]) == (8, 8, 8)
    requests = run["requests"]
    assert [r["index"] for r in requests] == list(range(8))
    assert all(sum(r["chunk_tokens"]) == 8 and r["error"] is None for r in requests)
    # One ITL per gap between successive chunks.
    assert metrics["itl"]["count"] == sum(len(r["chunk_times"]) - 1 for r in requests)
    assert metrics["output_throughput"] == pytest.approx(64 / metrics["duration_s"], rel=1e-12)

    assert sorted(p.name for p in plot_dir.iterdir()) == ["latency_cdf_rate_20.png"]
    assert (plot_dir / "latency_cdf_rate_20.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_runs_each_rate_and_plots_throughput_against_rate(endpoint: str, tmp_path: Path) -> None:
    result_path, plot_dir = tmp_path / "sweep.json", tmp_path / "plots"
    # One request at a time, so each finishes before the next: the prefix cache hits are exact.
    status = _bench("--target", endpoint, "--workload", "prefix", "--num-prefixes", "2", "--prefix-len", "32",
                    "--input-len", "8", "--num-prompts", "8", "--output-len", "4", "--ignore-eos", "--seed", "2",
                    "--max-concurrency", "1", "--sweep", "20,inf", "--goodput", "e2el:60000",
                    "--result-json", str(result_path), "--plot-dir", str(plot_dir), "--disable-tqdm")
    assert status == 0
    runs = json.loads(result_path.read_text())["runs"]
    assert [run["request_rate"] for run in runs] == [20.0, "inf"]
    for run in runs:
        metrics = run["metrics"]
        assert (metrics["completed"], metrics["failed"], metrics["good_requests"]) == (8, 0, 8)
        assert (metrics["total_prompt_tokens"], metrics["total_output_tokens"]) == (320, 32)
    # 40-token prompts (2 full blocks of 16 are the prefix). First run: the first request of each
    # prefix computes it, the 6 others reuse its 32 tokens. Second run: all 8 reuse them.
    assert [run["metrics"]["total_cached_prompt_tokens"] for run in runs] == [192, 256]
    assert [run["metrics"]["prefix_cache_hit_rate"] for run in runs] == [0.6, 0.8]
    names = sorted(p.name for p in plot_dir.iterdir())
    assert names == ["latency_cdf_rate_20.png", "latency_cdf_rate_inf.png", "sweep_throughput.png"]
    assert all(len((plot_dir / name).read_bytes()) > 1000 for name in names)


def test_failed_requests_are_reported_by_grpc_status(endpoint: str, tmp_path: Path) -> None:
    dataset, result_path = tmp_path / "requests.jsonl", tmp_path / "result.json"
    # Token 600 is past the tiny model's 512-token vocabulary: the server refuses that request.
    dataset.write_text(
        '{"prompt_token_ids": [20, 21, 22], "output_len": 3}\n{"prompt_token_ids": [600], "output_len": 3}\n'
    )
    status = _bench("--target", endpoint, "--workload", "file", "--dataset", str(dataset), "--num-prompts", "2",
                    "--ignore-eos", "--result-json", str(result_path), "--disable-tqdm")
    assert status == 0
    (run,) = json.loads(result_path.read_text())["runs"]
    metrics = run["metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["errors_by_code"]) == (1, 1, {"INVALID_ARGUMENT": 1})
    assert metrics["first_errors"][0].startswith("INVALID_ARGUMENT: ")
    assert (metrics["total_prompt_tokens"], metrics["total_output_tokens"], metrics["ttft"]["count"]) == (3, 3, 1)
    assert run["requests"][1]["error"]["code"] == "INVALID_ARGUMENT"


def test_an_unreachable_target_fails_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on: bound here, never listened
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
        assert _bench("--target", target, "--num-prompts", "1", "--disable-tqdm") == 1
    assert f"cannot describe the model served at {target}: UNAVAILABLE" in capsys.readouterr().err
