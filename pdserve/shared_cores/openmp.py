"""libgomp's pools and spin in a serving process: one pool per process, and spinning only while the cores are idle.

libgomp gives every thread that starts a parallel region a pool of worker
threads, kept until that thread ends, and counts the threads of all pools
together. Once they outnumber the CPUs, a worker that finishes its share spins
100 times instead of 300,000 before it sleeps (``GOMP_SPINCOUNT`` in libgomp's
manual), so nearly every parallel region pays a futex wake-up, as under
``OMP_WAIT_POLICY=PASSIVE``.

A worker process that loaded its model on the main thread and stepped the
engine on the engine thread had two pools: four OpenMP threads on a two-CPU
machine. With libgomp's default wait policy its float32 decode steps took
61-77 ms against 50-52 ms with the model loaded on a thread that ends (the same
run, alternated), and a 32-row ``F.linear`` plus a SiLU took 27-39% longer on a
second thread once the main thread had a pool (a 2-vCPU Zen 5; the steps as
``python -m benchmarks.cluster_throughput --step-trace DIR`` times them).
Loading on a thread that ends leaves the engine thread the only pool. Under
``OMP_WAIT_POLICY=PASSIVE`` (which ``pdserve up`` sets where engines without a
governor share the cores) every region sleeps anyway, and this changes nothing.

The same throttle, switched on and off at run time, is ``SpinGovernor``:
spinning is what makes a worker's many short parallel regions cheap when it
has the cores to itself, and what wrecks everybody's throughput when two
engines compute on the same cores (``benchmarks.cluster_throughput``'s burst took
21-26 s spinning against 9.5 s asleep, 1P+1D on a 2-vCPU Zen 5). The governor reads how much CPU other
processes used on this process's CPUs (``/proc/stat`` less its own time) and
lets libgomp spin only while they leave this process's threads their cores.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

SPIN_MODES = ("adaptive", "libgomp")

T = TypeVar("T")


def on_a_passing_thread(fn: Callable[[], T], name: str = "pdserve-load") -> T:
    """``fn()`` run on a thread of its own that ends when it returns: its result, or its exception raised here.

    Whatever OpenMP pool ``fn`` starts ends with that thread, so the thread that
    later steps the engine is the process's only pool (see the module docstring).
    """
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as error:  # noqa: BLE001 - raised again on the calling thread
            failure.append(error)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


class SpinGovernor:
    """Turns libgomp's spin off while other processes compute on this process's CPUs, and on again once they stop.

    ``update()`` runs on the engine thread before each engine step, between the
    layers of a step (``LLMEngine.between_layers``), and before queued engine
    commands run (a pushed layer's KV written in is an OpenMP region too).
    Every ``window_s`` it reads the CPU time spent on ``cpus``
    (``read_busy_s``: all processes) less this process's own (``read_own_s``)
    over the window: the CPUs others used. Above ``headroom + busy_cpus``
    (headroom: the CPUs this process's ``threads`` leave free), it throttles;
    below ``headroom + idle_cpus`` it spins again. A window is as long as the
    engine's work makes it: one that spans an idle engine averages over it.

    Throttling runs ``open_team(team)`` on a thread of its own that then waits:
    that thread's pool of ``team - 1`` workers makes libgomp count more threads
    than CPUs, so every idle worker spins 100 times instead of 300,000 before it
    sleeps. Ending that thread ends its pool and the count falls back.
    """

    def __init__(
        self,
        threads: int,
        cpus: int,
        open_team: Callable[[int], None],
        read_busy_s: Callable[[], float],
        read_own_s: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 0.2,
        busy_cpus: float = 0.3,
        idle_cpus: float = 0.15,
    ) -> None:
        if not 0 <= idle_cpus <= busy_cpus:
            raise ValueError(f"need 0 <= idle_cpus <= busy_cpus, got {idle_cpus} and {busy_cpus}")
        if threads > cpus:
            raise ValueError(f"{threads} threads on {cpus} CPUs: libgomp never spins long there already")
        self.threads, self.cpus = threads, cpus
        self.headroom = cpus - threads
        # libgomp counts the engine's pool (threads, its master included) plus this team's workers.
        self.team = cpus - threads + 2
        self._open_team = open_team
        self._read_busy_s, self._read_own_s, self._clock = read_busy_s, read_own_s, clock
        self.window_s, self.busy_cpus, self.idle_cpus = window_s, busy_cpus, idle_cpus
        self.switches = 0
        self.others_cpus = 0.0  # what the last full window measured
        self.stopped = False  # True once a reading failed: libgomp's own policy from then on
        self._release: threading.Event | None = None
        self._holder: threading.Thread | None = None
        self._last: tuple[float, float, float] | None = None

    @property
    def throttled(self) -> bool:
        return self._holder is not None

    def update(self) -> None:
        """Measure the window if it is over, and throttle or spin as it says; cheap in between."""
        now = self._clock()
        last = self._last
        if self.stopped or last is not None and now - last[0] < self.window_s:
            return
        try:
            sample = (now, self._read_busy_s(), self._read_own_s())
        except OSError as error:  # not expected once the first read worked; the engine thread must not die of it
            log.warning("adaptive OpenMP spin stops (%s): libgomp spins as OMP_WAIT_POLICY says", error)
            self.close()
            self.stopped = True
            return
        self._last = sample
        if last is None:
            return
        self.others_cpus = ((sample[1] - last[1]) - (sample[2] - last[2])) / (now - last[0])
        if not self.throttled and self.others_cpus > self.headroom + self.busy_cpus:
            self._throttle()
        elif self.throttled and self.others_cpus < self.headroom + self.idle_cpus:
            self._spin()

    def close(self) -> None:
        """Spin as libgomp would without the governor, and end its thread."""
        if self.throttled:
            self._spin()

    def _throttle(self) -> None:
        release, ready = threading.Event(), threading.Event()

        def hold() -> None:
            try:
                self._open_team(self.team)
            finally:
                ready.set()
            release.wait()

        holder = threading.Thread(target=hold, name="pdserve-openmp-throttle", daemon=True)
        holder.start()
        ready.wait()
        self._release, self._holder = release, holder
        self.switches += 1
        log.debug("OpenMP spin off: other processes used %.2f CPUs", self.others_cpus)

    def _spin(self) -> None:
        assert self._release is not None and self._holder is not None
        self._release.set()
        self._holder.join()
        self._release = self._holder = None
        self.switches += 1
        log.debug("OpenMP spin on: other processes used %.2f CPUs", self.others_cpus)


def cpu_busy_reader(cpus: frozenset[int], stat: Path = Path("/proc/stat")) -> Callable[[], float]:
    """A function giving the seconds ``cpus`` have been busy since boot (any process), from ``/proc/stat``.

    Busy is user, nice, system, irq, softirq and steal time (a CPU the hypervisor gave to another guest
    is not free either); idle and iowait are not. Raises ``OSError`` where the file cannot be read.
    """
    ticks_per_s = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        busy = 0
        with stat.open(encoding="ascii") as lines:
            for line in lines:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if int(name[3:]) in cpus:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                    busy += user + nice + system + irq + softirq + steal
        return busy / ticks_per_s

    read()  # fails here, not on the engine thread, where it cannot be read
    return read


def spin_governor(mode: str) -> SpinGovernor | None:
    """The governor for this process under ``mode`` (``SPIN_MODES``), or None where it has nothing to do.

    None for ``libgomp`` (its own policy: ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``), under
    ``OMP_WAIT_POLICY=PASSIVE`` (nothing spins), with one torch thread (no parallel regions) or more
    threads than CPUs (libgomp throttles for good), and where it cannot work: a package built without its
    kernels (``openmp_team`` is one of their operators), no ``/proc/stat``.
    """
    if mode not in SPIN_MODES:
        raise ValueError(f"openmp spin must be one of {', '.join(SPIN_MODES)}, got {mode!r}")
    if mode == "libgomp" or os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        return None
    import torch

    from pdserve.engine.native import load_kernel_ops

    threads = torch.get_num_threads()
    cpus = frozenset(os.sched_getaffinity(0))
    if not 1 < threads <= len(cpus):
        return None
    kernels = load_kernel_ops()
    if kernels is None:
        log.warning("adaptive OpenMP spin is off (no kernels in this package): libgomp spins as OMP_WAIT_POLICY says")
        return None
    try:
        read_busy_s = cpu_busy_reader(cpus)
    except OSError as error:
        log.warning("adaptive OpenMP spin is off (%s): libgomp spins as OMP_WAIT_POLICY says", error)
        return None
    team = kernels.ops.openmp_team

    def open_team(size: int) -> None:
        started = team(size)
        if started != size:  # OMP_DYNAMIC or OMP_THREAD_LIMIT: the count stays under the CPUs
            log.warning("an OpenMP team of %d started %d threads: libgomp may keep spinning", size, started)

    return SpinGovernor(threads, len(cpus), open_team, read_busy_s)
