"""Every engine step as one JSON line, to see where a run's time goes: ``PDSERVE_STEP_TRACE_DIR``.

With the variable set to a directory, each engine a process builds writes
``steps-<pid>-<n>.jsonl`` there (n counts the process's engines from 0), one
line per step that ran something::

    {"started": 2031.98, "seqs": 14, "tokens": 14, "wall_s": 0.112, "cpu_s": 0.061}

``started`` is ``time.monotonic()``, one clock for every process of a
machine, so the steps of a prefill worker and a decode worker line up;
``seqs`` and ``tokens`` are the step's scheduled sequences and tokens
(prefill chunks plus one per decoding sequence, more with speculation);
``cpu_s`` is the engine thread's own CPU time, without its OpenMP workers.
``benchmarks/step_trace.py`` reads the files back and sums them up.
Unset (the default), nothing is timed or written.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "PDSERVE_STEP_TRACE_DIR"

_engines = itertools.count()


@dataclass(frozen=True)
class StepRecord:
    started: float
    seqs: int
    tokens: int
    wall_s: float
    cpu_s: float


class StepTrace:
    """Appends one ``StepRecord`` per step to this engine's file, line by line (a crash loses no step)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"steps-{os.getpid()}-{next(_engines)}.jsonl"
        self._file = self.path.open("a", buffering=1, encoding="utf-8")

    @classmethod
    def from_env(cls) -> StepTrace | None:
        directory = os.environ.get(ENV, "").strip()
        return cls(Path(directory)) if directory else None

    def begin(self) -> tuple[float, float, float]:
        """The step's start: its monotonic time, a precise wall clock and the thread's CPU clock."""
        return time.monotonic(), time.perf_counter(), time.thread_time()

    def end(self, begun: tuple[float, float, float], seqs: int, tokens: int) -> None:
        started, wall, cpu = begun
        record = StepRecord(round(started, 6), seqs, tokens, round(time.perf_counter() - wall, 6),
                            round(time.thread_time() - cpu, 6))
        self._file.write(json.dumps(asdict(record)) + "\n")


def read_trace(path: Path) -> list[StepRecord]:
    """The steps one engine wrote, in order."""
    with path.open(encoding="utf-8") as lines:
        return [StepRecord(**json.loads(line)) for line in lines if line.strip()]
