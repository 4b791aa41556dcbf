"""``benchmarks.step_trace``: engine step files summed up by phase, and cluster_throughput's round-1 report."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from benchmarks import step_trace
from benchmarks.cluster_throughput import gap_split_report, probe_gap_splits, step_report
from benchmarks.workload import RunResult
from pdserve.engine.step_trace import StepRecord

# A decode worker's burst: one request decoding alone, a prefill step (speculation-free: more tokens
# than sequences), then 3 sequences decoding, then 2.
STEPS = [
    StepRecord(100.00, 1, 1, 0.060, 0.035),
    StepRecord(100.10, 1, 1, 0.060, 0.035),
    StepRecord(100.20, 3, 300, 0.500, 0.400),
    StepRecord(100.70, 3, 3, 0.080, 0.070),
    StepRecord(100.80, 3, 3, 0.080, 0.070),
    StepRecord(100.90, 3, 3, 0.080, 0.070),
    StepRecord(101.00, 2, 2, 0.050, 0.045),
]


def test_phases_group_decode_steps_of_one_batch_size_and_keep_each_prefill_step_apart() -> None:
    phases = step_trace.phases(STEPS)
    assert [(p.prefill, p.seqs, p.tokens, p.steps) for p in phases] == [
        (False, 1, 2, 2), (True, 3, 300, 1), (False, 3, 9, 3), (False, 2, 2, 1)
    ]
    decode3 = phases[2]
    assert (decode3.started, round(decode3.ended, 6)) == (100.70, 100.98)
    assert (round(decode3.wall_s, 6), round(decode3.cpu_s, 6)) == (0.24, 0.21)


def test_describe_gives_times_from_the_origin_and_costs_per_step() -> None:
    assert step_trace.describe("decode-0", STEPS[:3], origin=99.5) == [
        "decode-0: 3 steps, 302 tokens, 0.62 s stepping, 0.47 s engine-thread CPU",
        "     0.50-   0.66 s  decode    1 seqs x   2 steps:     60 ms wall,    35 ms CPU per step",
        "     0.70-   1.20 s  prefill   300 tokens,   3 seqs:    500 ms wall,   400 ms CPU per step",
    ]
    assert step_trace.describe("idle", []) == ["idle: no steps"]


def test_the_window_keeps_steps_started_within_it() -> None:
    assert step_trace.window(STEPS, 100.15, 100.85) == STEPS[2:5]
    assert step_trace.window(STEPS, None, None) == STEPS


def _write(directory: Path, name: str, steps: list[StepRecord]) -> None:
    with (directory / f"{name}.jsonl").open("w") as out:
        for step in steps:
            out.write(json.dumps(asdict(step)) + "\n")


def test_cluster_throughputs_report_shows_round_one_of_each_engine_by_its_process_name(tmp_path: Path) -> None:
    # This process's engine of round 1 (steps in its timed generate only), another in-process engine
    # of a later round (no step in round 1's windows), and the decode worker's steps in the burst.
    _write(tmp_path, f"steps-{os.getpid()}-0", [StepRecord(10.0, 2, 10, 0.1, 0.1), StepRecord(12.0, 2, 2, 0.05, 0.05)])
    _write(tmp_path, f"steps-{os.getpid()}-1", [StepRecord(500.0, 2, 10, 0.1, 0.1)])
    _write(tmp_path, "steps-4242-0", [StepRecord(19.0, 1, 1, 0.06, 0.03), StepRecord(20.5, 1, 1, 0.06, 0.03)])
    local = RunResult(name="pdserve", wall_s=1.0, token_ids=(), setup_s=0.0,
                      details={"started_monotonic": 11.5, "ended_monotonic": 13.0})
    report = step_report(tmp_path, {"local": local, "cluster_window": (20.0, 25.0)}, {"decode-0": 4242, "gateway": 7})
    assert report.splitlines() == [
        "round 1's engine steps (seconds from the start of each side's run):",
        "in-process: 1 steps, 2 tokens, 0.05 s stepping, 0.05 s engine-thread CPU",
        "     0.50-   0.55 s  decode    2 seqs x   1 steps:     50 ms wall,    50 ms CPU per step",
        "decode-0: 1 steps, 1 tokens, 0.06 s stepping, 0.03 s engine-thread CPU",
        "     0.50-   0.56 s  decode    1 seqs x   1 steps:     60 ms wall,    30 ms CPU per step",
    ]


# A decode worker's steps around a handoff: 100 ms steps back to back, then the handed-off request's
# first step (3 sequences) from 100.45 to 100.57.
AROUND_A_HANDOFF = [
    StepRecord(100.00, 2, 2, 0.100, 0.09),
    StepRecord(100.10, 2, 2, 0.100, 0.09),
    StepRecord(100.20, 2, 2, 0.100, 0.09),
    StepRecord(100.45, 3, 3, 0.120, 0.10),
    StepRecord(100.57, 3, 3, 0.120, 0.10),
]


def _ms(split: step_trace.GapSplit) -> tuple[float, ...]:
    return tuple(round(1000 * value, 3) for value in asdict(split).values())


def test_a_gap_is_split_into_the_step_in_flight_other_waits_its_own_step_and_the_relay() -> None:
    # First token at 100.23, inside the step of 100.20-100.30; the request's step starts at 100.45
    # and ends at 100.57; the second token arrives 4 ms later. 70 + 150 + 120 + 4 = 344 ms, the gap.
    split = step_trace.split_gap(AROUND_A_HANDOFF, 100.23, 100.574)
    assert split is not None
    assert _ms(split) == (70.0, 150.0, 120.0, 4.0)
    assert round(sum(asdict(split).values()), 6) == round(100.574 - 100.23, 6)


def test_a_first_token_between_steps_waits_for_no_step_in_flight() -> None:
    # 100.35: no step runs (the last ended at 100.30), so all the wait before 100.45 is "other".
    split = step_trace.split_gap(AROUND_A_HANDOFF, 100.35, 100.58)
    assert split is not None
    assert _ms(split) == (0.0, 100.0, 120.0, 10.0)


def test_a_step_that_started_before_the_first_token_arrived_counts_from_its_arrival() -> None:
    # The request joined the step of 100.45 before its first token reached the client (at 100.47):
    # only the rest of that step is in the gap.
    split = step_trace.split_gap(AROUND_A_HANDOFF, 100.47, 100.575)
    assert split is not None
    assert _ms(split) == (0.0, 0.0, 100.0, 5.0)


def test_a_second_token_computed_before_the_first_arrived_is_all_relay() -> None:
    # Both tokens reach the client after the step of 100.45 ended, the second one 2 ms behind.
    split = step_trace.split_gap(AROUND_A_HANDOFF, 100.58, 100.582)
    assert split is not None
    assert _ms(split) == (0.0, 0.0, 0.0, 2.0)


def test_no_split_where_no_step_ended_before_the_second_token() -> None:
    assert step_trace.split_gap(AROUND_A_HANDOFF, 99.0, 100.05) is None
    assert step_trace.split_gap([], 100.0, 100.1) is None


def test_cluster_throughput_splits_each_probes_gap_over_the_decode_workers_own_steps(tmp_path: Path) -> None:
    # The prefill worker's trace (pid 4141) has a step that would match too; only decode-0's (4242) count.
    _write(tmp_path, "steps-4141-0", [StepRecord(100.30, 1, 1000, 0.200, 0.2)])
    _write(tmp_path, "steps-4242-0", AROUND_A_HANDOFF)
    probes = [{"first_at": 100.23, "second_at": 100.574}, {"first_at": 100.35, "second_at": 100.58},
              {"first_at": 99.0, "second_at": 100.05}]
    splits = probe_gap_splits(tmp_path, 4242, probes)
    assert [None if s is None else _ms(s) for s in splits] == [(70.0, 150.0, 120.0, 4.0), (0.0, 100.0, 120.0, 10.0), None]
    assert gap_split_report(splits) == (
        "the probes' gaps over the decode worker's steps (2 of 3), p50s: waiting for the decode step in flight "
        "35 ms, other waits (landing, start, hold) 125 ms, its own first decode step 120 ms, relay 7 ms")
    assert gap_split_report([None]) == (
        "the probes' gaps: no decode step of the decode worker's trace ended before a second token")
