"""A worker's niceness: it takes the cores the other processes on the machine leave idle."""

from __future__ import annotations

import os


def raise_niceness(increment: int) -> None:
    """Lower this process's CPU priority by ``increment``, before the engine, the OpenMP pool and gRPC start threads.

    Linux keeps a niceness per thread and a new thread takes its creator's: the threads that exist
    already (importing torch starts one) are set one by one, the rest inherit it.
    """
    tasks = "/proc/self/task"
    for thread_id in (int(name) for name in os.listdir(tasks)) if os.path.isdir(tasks) else (0,):
        os.setpriority(os.PRIO_PROCESS, thread_id, os.getpriority(os.PRIO_PROCESS, thread_id) + increment)
