"""Keeps a local cluster's processes running: restarts with backoff, health probes, crash-loop give-up.

The policy follows systemd and Kubernetes: a child that exits is started
again after a delay that doubles with each restart (``RestartSec`` growing
like Kubernetes' CrashLoopBackOff, capped), and is given up on once it needed
more than ``max_restarts`` restarts within ``window_s`` seconds (systemd's
``StartLimitBurst`` / ``StartLimitIntervalSec``). A child that is alive but
not serving (its gRPC health NOT_SERVING or unanswered, or Redis not
accepting connections) for ``unhealthy_after_s`` is killed and restarted the
same way: that covers a hung process, which no exit status reveals.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.launcher import LocalCluster

log = logging.getLogger(__name__)

# A worker started from the CLI exits with this status shortly after its engine
# thread died, so that whatever supervises it (`pdserve up`, compose, Kubernetes)
# starts a fresh one instead of leaving a process that can only refuse work.
EXIT_ENGINE_DEAD = 3


@dataclass(frozen=True)
class RestartPolicy:
    """When ``pdserve up`` restarts a child, and when it gives up."""

    initial_backoff_s: float = 0.5  # delay before the first restart; doubles with each restart in the window
    max_backoff_s: float = 30.0
    max_restarts: int = 5  # restarts allowed within window_s; one more exit gives up
    window_s: float = 60.0
    health_interval_s: float = 1.0  # how often each running child is probed
    unhealthy_after_s: float = 10.0  # not serving for this long: killed and restarted
    start_timeout_s: float = 300.0  # a restarted child not ready by then is killed (and counted as a crash)

    def __post_init__(self) -> None:
        for name in ("initial_backoff_s", "max_backoff_s", "window_s", "health_interval_s", "unhealthy_after_s",
                     "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s}) must be >= initial_backoff_s ({self.initial_backoff_s})")


class RestartBudget:
    """One child's restarts in the sliding window: how long to wait before the next one, or None to give up."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._restarts: deque[float] = deque()  # when each restart in the window was decided

    def next_delay(self, now: float) -> float | None:
        """Record an exit at ``now``; the delay before restarting, or None once the budget is spent."""
        policy = self.policy
        while self._restarts and self._restarts[0] <= now - policy.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= policy.max_restarts:
            return None
        delay = min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** len(self._restarts))
        self._restarts.append(now)
        return delay

    @property
    def restarts_in_window(self) -> int:
        return len(self._restarts)


def describe_exit(returncode: int) -> str:
    """An exit status as a person reads it: ``-9`` is ``-9 (SIGKILL)``."""
    if returncode < 0:
        try:
            return f"{returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return str(returncode)
    if returncode == EXIT_ENGINE_DEAD:
        return f"{returncode} (its engine thread died)"
    return str(returncode)


class GaveUp(Exception):
    """A child kept failing: more than ``max_restarts`` restarts within ``window_s``."""


@dataclass
class _ChildState:
    budget: RestartBudget
    restart_at: float | None = None  # exited: restart at this time
    starting_since: float | None = None  # restarted: not ready yet
    unhealthy_since: float | None = None
    next_probe_at: float = 0.0
    reason: str = ""  # why it was killed, when the supervisor killed it


class Supervisor:
    """Watches every process of a started ``LocalCluster`` until ``should_stop`` says so.

    One thread does it all, ticking every ``tick_s``: processes are started
    without waiting for them (a restart waits for its ready file on later
    ticks), so the rest of the cluster stays supervised meanwhile.
    """

    def __init__(self, cluster: LocalCluster, policy: RestartPolicy, tick_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.policy = policy
        self.tick_s = tick_s
        self._clock = clock
        self._states = {name: _ChildState(RestartBudget(policy)) for name in cluster.child_names()}

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Supervise until ``should_stop()``; raises ``GaveUp`` when a child is given up on."""
        while not should_stop():
            self.tick()
            time.sleep(self.tick_s)

    def tick(self) -> None:
        now = self._clock()
        for name, state in self._states.items():
            if state.restart_at is not None:
                if now >= state.restart_at:
                    state.restart_at, state.starting_since, state.unhealthy_since = None, now, None
                    self.cluster.respawn(name)
                continue
            process = self.cluster.process(name)
            if process.poll() is not None:
                self._on_exit(name, state, process.returncode, now)
            elif state.starting_since is not None:
                self._check_started(name, state, now)
            elif now >= state.next_probe_at:
                self._probe(name, state, now)

    def _on_exit(self, name: str, state: _ChildState, returncode: int, now: float) -> None:
        why = f"{state.reason}; " if state.reason else ""
        state.reason = ""
        tail = _indent(self.cluster.log_tail(name))
        delay = state.budget.next_delay(now)
        if delay is None:
            policy = self.policy
            raise GaveUp(f"{name} exited with status {describe_exit(returncode)} ({why}{policy.max_restarts} restarts "
                         f"within {policy.window_s:g} s already); giving up: fix the cause its log ends with "
                         f"(below), or allow more with --max-restarts / --restart-window\n{tail}".rstrip())
        log.warning("%s exited with status %s; %srestarting it in %.1f s (restart %d within %g s); its log ends with:\n%s",
                    name, describe_exit(returncode), why, delay, state.budget.restarts_in_window,
                    self.policy.window_s, tail)
        state.restart_at, state.starting_since = now + delay, None

    def _check_started(self, name: str, state: _ChildState, now: float) -> None:
        assert state.starting_since is not None
        if self.cluster.is_ready(name):
            state.starting_since, state.next_probe_at = None, now + self.policy.health_interval_s
            log.warning("%s is back on %s (pid %d)", name, self.cluster.location(name), self.cluster.process(name).pid)
        elif now - state.starting_since > self.policy.start_timeout_s:
            state.reason = f"killed: not ready {self.policy.start_timeout_s:g} s after its restart"
            self.cluster.kill(name)

    def _probe(self, name: str, state: _ChildState, now: float) -> None:
        serving = self.cluster.is_serving(name)
        # A probe may take its whole timeout: the next one is scheduled from when it ended.
        now = self._clock()
        state.next_probe_at = now + self.policy.health_interval_s
        if serving:
            state.unhealthy_since = None
            return
        if state.unhealthy_since is None:
            state.unhealthy_since = now
        elif now - state.unhealthy_since >= self.policy.unhealthy_after_s:
            log.warning("%s has not been serving for %.0f s (health NOT_SERVING or no answer); killing it",
                        name, now - state.unhealthy_since)
            state.reason = f"killed: not serving for {now - state.unhealthy_since:.0f} s"
            self.cluster.kill(name)


def _indent(text: str) -> str:
    return "\n".join(f"    | {line}" for line in text.splitlines())
