"""One OpenMP pool per serving process: work that would give a second thread a pool runs on a thread that ends.

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
second thread once the main thread had a pool (BENCHMARKS.md, session 10).
Loading on a thread that ends leaves the engine thread the only pool. Under
``OMP_WAIT_POLICY=PASSIVE``, which ``pdserve up`` sets where several of its
engines share the cores, every region sleeps anyway, and this changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

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
