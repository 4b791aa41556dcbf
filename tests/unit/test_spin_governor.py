"""``SpinGovernor``: libgomp spins only while other processes leave this process's CPUs idle (pdserve/shared_cores/openmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from pdserve.shared_cores.openmp import SpinGovernor, cpu_busy_reader, spin_governor


class FakeHost:
    """A clock, the CPU time every process spent on this process's CPUs, and this process's own."""

    def __init__(self) -> None:
        self.now = 100.0
        self.busy_s = 5000.0
        self.own_s = 40.0

    def advance(self, seconds: float, others_cpus: float, own_cpus: float = 1.0) -> None:
        self.now += seconds
        self.own_s += own_cpus * seconds
        self.busy_s += (others_cpus + own_cpus) * seconds


def make_governor(host: FakeHost, threads: int = 2, cpus: int = 2, **kwargs: float) -> tuple[SpinGovernor, list[int]]:
    teams: list[int] = []
    governor = SpinGovernor(threads, cpus, teams.append, read_busy_s=lambda: host.busy_s,
                            read_own_s=lambda: host.own_s, clock=lambda: host.now, **kwargs)
    return governor, teams


def test_throttles_while_others_compute_and_spins_once_they_stop() -> None:
    host = FakeHost()
    governor, teams = make_governor(host)
    governor.update()  # the first sample only starts a window
    host.advance(0.1, others_cpus=1.0)
    governor.update()  # within the window: nothing read, nothing decided
    assert (governor.throttled, governor.others_cpus) == (False, 0.0)
    host.advance(0.15, others_cpus=1.0)
    governor.update()
    # 0.25 s in which others used 1 CPU: above the 0.3 CPU a two-thread process on two CPUs allows.
    assert governor.others_cpus == pytest.approx(1.0)
    assert governor.throttled
    assert teams == [2]  # two threads counted beside the engine's two, on two CPUs
    try:
        # Between the two thresholds it stays as it is (no flapping on the boundary).
        host.advance(0.2, others_cpus=0.2)
        governor.update()
        assert governor.others_cpus == pytest.approx(0.2)
        assert governor.throttled
        host.advance(0.2, others_cpus=0.1)
        governor.update()
        assert not governor.throttled
        host.advance(0.2, others_cpus=0.25)
        governor.update()
        assert not governor.throttled
        assert (governor.switches, teams) == (2, [2])
    finally:
        governor.close()


def test_a_long_window_averages_over_it() -> None:
    host = FakeHost()
    governor, teams = make_governor(host)
    governor.update()
    # A 3 s prefill step (or an idle engine) while others used 2 CPUs for 0.3 s of it: 0.2 CPUs on average.
    host.advance(2.7, others_cpus=0.0)
    host.advance(0.3, others_cpus=2.0)
    governor.update()
    assert governor.others_cpus == pytest.approx(0.2)
    assert (governor.throttled, teams) == (False, [])
    host.advance(3.0, others_cpus=0.5)
    governor.update()
    try:
        assert governor.throttled
    finally:
        governor.close()


def test_cpus_the_threads_leave_free_are_headroom() -> None:
    host = FakeHost()
    # 4 threads on 16 CPUs: others may use 12 CPUs before spinning takes anything from them.
    governor, teams = make_governor(host, threads=4, cpus=16)
    assert (governor.headroom, governor.team) == (12, 14)  # 4 + 14 - 1 = 17 threads counted > 16 CPUs
    governor.update()
    host.advance(0.2, others_cpus=12.2)
    governor.update()
    assert not governor.throttled
    host.advance(0.2, others_cpus=12.5)
    governor.update()
    try:
        assert governor.throttled
        assert teams == [14]
    finally:
        governor.close()
    assert not governor.throttled


def test_close_ends_the_thread_that_holds_the_team() -> None:
    host = FakeHost()
    governor, _ = make_governor(host)
    governor.update()
    host.advance(0.2, others_cpus=1.5)
    governor.update()
    holders = [thread for thread in threading.enumerate() if thread.name == "pdserve-openmp-throttle"]
    assert len(holders) == 1
    governor.close()
    assert not holders[0].is_alive()
    assert not governor.throttled
    governor.close()  # twice is fine


def test_a_failed_reading_ends_the_governor_and_leaves_libgomp_spinning() -> None:
    host = FakeHost()
    failing = [False]

    def read_busy_s() -> float:
        if failing[0]:
            raise OSError("/proc/stat: gone")
        return host.busy_s

    governor = SpinGovernor(2, 2, lambda size: None, read_busy_s=read_busy_s, read_own_s=lambda: host.own_s,
                            clock=lambda: host.now)
    governor.update()
    host.advance(0.2, others_cpus=1.0)
    governor.update()
    assert governor.throttled
    failing[0] = True
    host.advance(0.2, others_cpus=1.0)
    governor.update()  # does not raise: it runs on the engine thread
    assert (governor.stopped, governor.throttled) == (True, False)
    failing[0] = False
    host.advance(0.2, others_cpus=1.0)
    governor.update()
    assert not governor.throttled


def test_thresholds_and_thread_count_are_checked() -> None:
    with pytest.raises(ValueError, match="idle_cpus <= busy_cpus"):
        SpinGovernor(2, 2, lambda size: None, read_busy_s=lambda: 0.0, busy_cpus=0.1, idle_cpus=0.2)
    with pytest.raises(ValueError, match="4 threads on 2 CPUs"):
        SpinGovernor(4, 2, lambda size: None, read_busy_s=lambda: 0.0)


def test_busy_time_is_read_for_the_given_cpus_only(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    #                user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        "cpu  9999 0 9999 9999 0 0 0 0 0 0\n"
        "cpu0 100 10 50 7000 300 1 2 3 0 0\n"
        "cpu1 200 20 60 8000 400 4 5 6 0 0\n"
        "cpu2 1000 0 1000 1000 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    ticks = os.sysconf("SC_CLK_TCK")
    read = cpu_busy_reader(frozenset({0, 1}), stat)
    assert read() == pytest.approx((100 + 10 + 50 + 1 + 2 + 3 + 200 + 20 + 60 + 4 + 5 + 6) / ticks)
    with pytest.raises(OSError):
        cpu_busy_reader(frozenset({0}), tmp_path / "missing")


def test_no_governor_where_it_has_nothing_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    assert spin_governor("libgomp") is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "Passive")
    assert spin_governor("adaptive") is None
    with pytest.raises(ValueError, match="adaptive, libgomp"):
        spin_governor("always")


# In a fresh interpreter with two torch threads: the team really starts (and so changes what libgomp
# counts), ends with its thread, and switches the spin of the engine pool's worker: that worker's CPU
# time over 40 short regions, each followed by a 20 ms pause, with the spin on and then off.
_MECHANISM = textwrap.dedent("""
    import os, time, threading, torch
    from pdserve.shared_cores.openmp import spin_governor

    torch.set_num_threads(2)

    def tasks():
        return set(os.listdir("/proc/self/task"))

    def cpu_ns(tid):
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])

    before = tasks()
    x = torch.ones(1 << 20)  # a parallel fill: the main thread's pool, with one worker thread
    x.add_(1)
    (worker,) = tasks() - before

    def spun_ns():
        start = cpu_ns(worker)
        for _ in range(40):
            x.add_(1)
            time.sleep(0.02)
        return cpu_ns(worker) - start

    governor = spin_governor("adaptive")
    spinning = spun_ns()
    count = len(tasks())
    governor._throttle()
    held = len(tasks())
    throttled = spun_ns()
    governor._spin()
    deadline = time.monotonic() + 10  # the team's workers exit just after their thread has
    while len(tasks()) > count and time.monotonic() < deadline:
        time.sleep(0.01)
    print(governor.team, count, held, len(tasks()), spinning, throttled)
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs for a two-thread OpenMP pool")
def test_a_held_team_stops_libgomp_spinning_and_ending_it_restores_the_spin() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OMP_", "GOMP_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    result = subprocess.run([sys.executable, "-c", _MECHANISM], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    team, count, held, after, spinning_ns, throttled_ns = map(int, result.stdout.split())
    cpus = len(os.sched_getaffinity(0))
    assert team == cpus  # 2 + team - 1 threads counted: one more than the CPUs
    assert held == count + team  # the holding thread and its team's team - 1 workers
    assert after == count
    # Spinning, the worker runs on after each region (libgomp's 300,000 spins, a few ms); throttled,
    # it sleeps after 100. Each region itself is a few microseconds of work.
    assert throttled_ns * 4 < spinning_ns, (spinning_ns, throttled_ns)
