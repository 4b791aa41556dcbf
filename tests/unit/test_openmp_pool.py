"""``pdserve.shared_cores.openmp.on_a_passing_thread``: its result and errors, and the OpenMP pool it leaves behind (none)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdserve.shared_cores.openmp import on_a_passing_thread

ROOT = Path(__file__).resolve().parents[2]


def test_the_result_comes_back_from_another_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def build() -> tuple[int, str]:
        seen.append(threading.current_thread())
        return 42, "engine"

    assert on_a_passing_thread(build) == (42, "engine")
    assert seen[0] is not threading.current_thread()
    assert seen[0].name == "pdserve-load"
    assert not seen[0].is_alive()


def test_an_error_is_raised_on_the_calling_thread_as_it_was() -> None:
    def fail() -> None:
        raise ValueError("model path 'x' does not exist")

    with pytest.raises(ValueError, match="model path 'x' does not exist"):
        on_a_passing_thread(fail)


# Run in a fresh interpreter: this test process's main thread has an OpenMP pool already.
_POOLS = """
import os, time, torch
from pdserve.shared_cores.openmp import on_a_passing_thread

torch.set_num_threads(2)


def threads():
    return len(os.listdir("/proc/self/task"))


def parallel_op():
    # 4M elements: far above ATen's grain size, so the add runs as an OpenMP parallel region.
    return float((torch.ones(1 << 22) * 2).sum())


def settled(expected):
    # A joined thread and its pool's worker leave the kernel's task list a moment after join() returns.
    deadline = time.monotonic() + 10
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()


before = threads()
assert on_a_passing_thread(parallel_op) == 2.0 * (1 << 22)
after_passing = settled(before)
parallel_op()
time.sleep(0.5)  # the main thread's pool does not go away, however long one waits
after_main = threads()
print(before, after_passing, after_main)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts threads in /proc; a pool needs two CPUs")
def test_the_passing_threads_openmp_pool_ends_with_it_while_the_main_threads_stays() -> None:
    done = subprocess.run([sys.executable, "-c", _POOLS], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr
    before, after_passing, after_main = map(int, done.stdout.split())
    # The passing thread and its pool's worker are gone: the count is back where it was.
    assert after_passing == before
    # The same region on the main thread starts a pool whose worker stays for the life of the process,
    # which is what loading the model there did to every worker process.
    assert after_main == before + 1
