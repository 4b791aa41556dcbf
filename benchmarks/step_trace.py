"""Where a run's engine steps went: the files ``PDSERVE_STEP_TRACE_DIR`` collects, summed up by phase.

    python -m benchmarks.cluster_throughput --step-trace /tmp/steps     (prints round 1's phases)
    python -m benchmarks.step_trace /tmp/steps [--since T] [--until T]

Each engine writes one file (``pdserve/engine/step_trace.py``). A phase is one step
that computes more tokens than it has sequences (a prefill chunk, or
speculative verification), or a run of consecutive steps that each compute
one token per sequence for the same number of sequences (plain decoding).
For each: when it started and ended (seconds from ``--since``, else from the
first step shown), its steps, the mean wall time and engine-thread CPU time
per step. The engine thread's CPU leaves out its OpenMP workers, so on two
threads a step's whole CPU cost is up to twice that.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.step_trace import StepRecord, read_trace


@dataclass(frozen=True)
class Phase:
    prefill: bool
    seqs: int
    tokens: int
    steps: int
    started: float
    ended: float
    wall_s: float
    cpu_s: float


def load(directory: Path) -> dict[str, list[StepRecord]]:
    """Every engine's steps in ``directory``, by file name without its suffix (``steps-<pid>-<n>``)."""
    return {path.stem: read_trace(path) for path in sorted(directory.glob("steps-*.jsonl"))}


def window(steps: list[StepRecord], since: float | None, until: float | None) -> list[StepRecord]:
    """The steps that started within [since, until] (monotonic seconds; None: unbounded)."""
    return [s for s in steps if (since is None or s.started >= since) and (until is None or s.started <= until)]


def phases(steps: list[StepRecord]) -> list[Phase]:
    result: list[Phase] = []
    for step in steps:
        prefill = step.tokens > step.seqs
        last = result[-1] if result else None
        if last is not None and not prefill and not last.prefill and last.seqs == step.seqs:
            result[-1] = Phase(False, step.seqs, last.tokens + step.tokens, last.steps + 1, last.started,
                               step.started + step.wall_s, last.wall_s + step.wall_s, last.cpu_s + step.cpu_s)
        else:
            result.append(Phase(prefill, step.seqs, step.tokens, 1, step.started, step.started + step.wall_s,
                                step.wall_s, step.cpu_s))
    return result


def describe(name: str, steps: list[StepRecord], origin: float | None = None) -> list[str]:
    """A header line for ``name``'s steps, then one line per phase; times in seconds from ``origin``."""
    if not steps:
        return [f"{name}: no steps"]
    origin = steps[0].started if origin is None else origin
    lines = [f"{name}: {len(steps)} steps, {sum(s.tokens for s in steps)} tokens, "
             f"{sum(s.wall_s for s in steps):.2f} s stepping, {sum(s.cpu_s for s in steps):.2f} s engine-thread CPU"]
    for phase in phases(steps):
        what = (f"prefill {phase.tokens:5d} tokens, {phase.seqs:3d} seqs" if phase.prefill
                else f"decode  {phase.seqs:3d} seqs x {phase.steps:3d} steps")
        lines.append(f"  {phase.started - origin:7.2f}-{phase.ended - origin:7.2f} s  {what}: "
                     f"{1000 * phase.wall_s / phase.steps:6.0f} ms wall, {1000 * phase.cpu_s / phase.steps:5.0f} ms CPU per step")
    return lines


@dataclass(frozen=True)
class GapSplit:
    """Where a handed-off request's first-to-second token gap went, against its decode worker's steps.

    The four parts add up to the gap: ``in_flight_s`` from the first token's arrival to the end of
    the decode step then running (the request cannot join a step under way), ``other_wait_s`` until
    the step that computes its second token starts (the KV landing, the start's trip, a hold),
    ``own_step_s`` that step's time after the first token arrived, and ``relay_s`` from its end to
    the second token's arrival."""

    in_flight_s: float
    other_wait_s: float
    own_step_s: float
    relay_s: float


def split_gap(steps: list[StepRecord], first_at: float, second_at: float) -> GapSplit | None:
    """The gap between a request's first token (``first_at``) and second (``second_at``), both as received
    (``time.monotonic``, one clock for every process of the machine), split over the decode worker's
    ``steps``. Its own step is the last one to end before ``second_at``; None where no step did."""
    own = next((s for s in reversed(steps) if s.started + s.wall_s <= second_at), None)
    if own is None:
        return None
    own_end = own.started + own.wall_s
    running = next((s for s in steps if s is not own and s.started <= first_at < s.started + s.wall_s), None)
    in_flight_end = first_at if running is None else min(running.started + running.wall_s, own.started)
    in_flight = max(0.0, in_flight_end - first_at)
    other = max(0.0, own.started - max(first_at, in_flight_end))
    # A second token computed before the first one reached the client (relays can overtake) is all relay.
    return GapSplit(in_flight, other, max(0.0, own_end - max(first_at, own.started)),
                    second_at - max(own_end, first_at))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--since", type=float, default=None, help="monotonic seconds: steps from then on")
    parser.add_argument("--until", type=float, default=None, help="monotonic seconds: steps until then")
    args = parser.parse_args()
    traces = load(args.directory)
    if not traces:
        parser.error(f"no steps-*.jsonl in {args.directory}")
    for name, steps in traces.items():
        print("\n".join(describe(name, window(steps, args.since, args.until), args.since)))


if __name__ == "__main__":
    main()
