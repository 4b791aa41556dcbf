"""``benchmarks.cluster_throughput``'s rounds: which prompts each round runs, which side goes first, the CLI's bounds."""

from __future__ import annotations

import sys

import pytest

from benchmarks import cluster_throughput
from benchmarks.cluster_throughput import round_order, round_seed


def test_the_first_round_keeps_the_seed_and_later_rounds_stay_clear_of_the_probes_workload() -> None:
    # One round is the benchmark as it was: the workload of --seed itself.
    assert [round_seed(0, i) for i in range(4)] == [0, 1000, 2000, 3000]
    assert [round_seed(7, i) for i in range(3)] == [7, 1007, 2007]
    # The probe phase's burst uses seed + 2; no round may run those prompts (they would be cached).
    assert all(round_seed(s, i) != s + 2 for s in range(5) for i in range(50))


def test_the_sides_alternate_which_runs_first() -> None:
    assert [round_order(i) for i in range(4)] == [
        ("in_process", "cluster"),
        ("cluster", "in_process"),
        ("in_process", "cluster"),
        ("cluster", "in_process"),
    ]


@pytest.mark.parametrize("repeats", ["0", "-2"])
def test_the_cli_refuses_fewer_than_one_round(repeats: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["cluster_throughput", "--repeats", repeats])
    with pytest.raises(SystemExit) as exit_info:
        cluster_throughput.main()  # refused before anything runs: no engine, no cluster
    assert exit_info.value.code == 2
    assert f"--repeats must be >= 1, got {repeats}" in capsys.readouterr().err


def test_the_cli_offers_never_for_the_served_path_without_a_handoff(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["cluster_throughput", "--disaggregation", "sometimes"])
    with pytest.raises(SystemExit):
        cluster_throughput.main()
    assert "choose from 'always', 'auto', 'never'" in capsys.readouterr().err


def test_the_transports_unloaded_time_is_measured_between_two_real_processes() -> None:
    # The benchmark's yardstick for the handoff: kv_transfer's own run, for one transport.
    measured = cluster_throughput._transport_unloaded("grpc", 32)
    # 2 blocks of 16 tokens x 30 layers x K and V x 3 heads x 64 dims x 4 bytes.
    assert measured["bytes"] == 2 * 16 * 30 * 2 * 3 * 64 * 4
    assert measured["lands_on"] == "cpu"
    assert measured["seconds"] > 0


def test_a_processs_cpu_seconds_come_from_proc_stat() -> None:
    import os
    import time

    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # some CPU time to read back
        pass
    # /proc counts in clock ticks (10 ms): the same time as the process clock, to a few ticks.
    assert abs(cluster_throughput.cpu_seconds(os.getpid()) - time.process_time()) < 0.05


def test_the_cpu_report_shows_each_process_and_the_share_of_the_machine() -> None:
    rounds = [{"in_process_cpu_s": 18.0, "in_process_wall_s": 10.0, "cluster_wall_s": 12.0,
               "cluster_cpu_s": {"prefill-0": 9.0, "decode-0": 10.5, "gateway": 2.5, "client": 1.0}}]
    assert cluster_throughput.cpu_report(rounds, 2) == (
        "CPU seconds per round (2 CPUs; the share is of CPUs x wall time):\n"
        "  round 1: in-process 18.0 (90%); cluster 23.0 (96%): prefill-0 9.0, decode-0 10.5, gateway 2.5, client 1.0"
    )


def test_each_workers_extra_flags_reach_that_worker_only_after_the_benchmarks_own() -> None:
    args = cluster_throughput.parse_args([
        "--prefill-niceness", "5", "--prefill-args", "--max-num-batched-tokens 8192 --batch-window-ms 100",
        "--decode-args", "--niceness 3", "--num-kv-blocks", "512"])
    config = cluster_throughput.cluster_config(args, {"PDSERVE_STEP_TRACE_DIR": "/tmp/t"})
    assert config.prefill_args == ("--niceness", "5", "--max-num-batched-tokens", "8192", "--batch-window-ms", "100")
    assert config.decode_args == ("--niceness", "3")
    assert config.engine_args == ("--num-kv-blocks", "512", "--openmp-spin", "adaptive")
    assert config.extra_env == {"PDSERVE_STEP_TRACE_DIR": "/tmp/t"}
    assert (config.dtype, config.disaggregation) == ("float32", "always")


def test_without_extra_flags_the_workers_get_only_the_benchmarks_own() -> None:
    config = cluster_throughput.cluster_config(cluster_throughput.parse_args([]), {})
    assert (config.prefill_args, config.decode_args) == ((), ())
    # One flag with no space in it: the `=` form, or argparse would take it for an option of its own.
    args = cluster_throughput.parse_args(["--decode-args=--niceness=3"])
    assert cluster_throughput.cluster_config(args, {}).decode_args == ("--niceness=3",)


def test_extra_flags_that_cannot_be_split_are_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cluster_throughput.parse_args(["--prefill-args", "--served-model-name 'unclosed"])
    assert exit_info.value.code == 2
    assert "argument --prefill-args: invalid split value: \"--served-model-name 'unclosed\"" in capsys.readouterr().err
