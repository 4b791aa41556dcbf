"""The supervisor's restart policy as pure logic: backoff, the crash-loop window, health-based kills. No processes."""

from __future__ import annotations

import pytest

from pdserve.supervisor import EXIT_ENGINE_DEAD, GaveUp, RestartBudget, RestartPolicy, Supervisor, describe_exit


def test_backoff_doubles_per_restart_in_the_window_up_to_the_cap() -> None:
    budget = RestartBudget(RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3.0, max_restarts=6, window_s=100.0))
    assert [budget.next_delay(float(t)) for t in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert budget.restarts_in_window == 6


def test_one_exit_more_than_max_restarts_within_the_window_gives_up() -> None:
    budget = RestartBudget(RestartPolicy(initial_backoff_s=1.0, max_backoff_s=30.0, max_restarts=3, window_s=60.0))
    assert [budget.next_delay(t) for t in (0.0, 10.0, 20.0)] == [1.0, 2.0, 4.0]
    assert budget.next_delay(30.0) is None
    assert budget.next_delay(59.9) is None  # still three restarts within the last 60 s


def test_restarts_older_than_the_window_no_longer_count_and_backoff_falls_back() -> None:
    budget = RestartBudget(RestartPolicy(initial_backoff_s=1.0, max_backoff_s=30.0, max_restarts=2, window_s=10.0))
    assert budget.next_delay(0.0) == 1.0
    assert budget.next_delay(5.0) == 2.0
    assert budget.next_delay(10.0) == 2.0  # the restart at 0 s left the window; the one at 5 s remains
    assert budget.restarts_in_window == 2
    assert budget.next_delay(14.0) is None
    assert budget.next_delay(25.0) == 1.0  # a quiet window: the backoff starts over


def test_max_restarts_zero_gives_up_at_the_first_exit() -> None:
    assert RestartBudget(RestartPolicy(max_restarts=0)).next_delay(0.0) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"initial_backoff_s": 0.0}, "initial_backoff_s must be > 0, got 0.0"),
        ({"window_s": -1.0}, "window_s must be > 0, got -1.0"),
        ({"max_restarts": -1}, "max_restarts must be >= 0, got -1"),
        ({"initial_backoff_s": 5.0, "max_backoff_s": 1.0}, "max_backoff_s (1.0) must be >= initial_backoff_s (5.0)"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(overrides: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        RestartPolicy(**overrides)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_exit_statuses_read_as_signal_names_and_the_engine_death_status() -> None:
    assert describe_exit(-9) == "-9 (SIGKILL)"
    assert describe_exit(-15) == "-15 (SIGTERM)"
    assert describe_exit(EXIT_ENGINE_DEAD) == "3 (its engine thread died)"
    assert describe_exit(1) == "1"


class _FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class _FakeCluster:
    """What the supervisor asks of a LocalCluster, recorded."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.current = {name: _FakeProcess(i) for i, name in enumerate(names)}
        self.ready = {name: True for name in names}
        self.serving = {name: True for name in names}
        self.events: list[tuple[str, str]] = []
        self._next_pid = 100

    def child_names(self) -> list[str]:
        return list(self.names)

    def process(self, name: str) -> _FakeProcess:
        return self.current[name]

    def respawn(self, name: str) -> None:
        self.events.append(("respawn", name))
        self._next_pid += 1
        self.current[name] = _FakeProcess(self._next_pid)

    def kill(self, name: str) -> None:
        self.events.append(("kill", name))
        self.current[name].returncode = -9

    def is_ready(self, name: str) -> bool:
        return self.ready[name]

    def is_serving(self, name: str) -> bool:
        self.events.append(("probe", name))
        return self.serving[name]

    def location(self, name: str) -> str:
        return f"127.0.0.1:{name}"

    def log_tail(self, name: str) -> str:
        return f"last words of {name}"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _supervisor(cluster: _FakeCluster, clock: _Clock, **policy: float) -> Supervisor:
    values = {"initial_backoff_s": 1.0, "max_backoff_s": 8.0, "max_restarts": 2, "window_s": 60.0,
              "health_interval_s": 1.0, "unhealthy_after_s": 3.0, **policy}
    return Supervisor(cluster, RestartPolicy(**values), clock=clock)  # type: ignore[arg-type]


def test_an_exited_child_is_respawned_after_its_backoff_and_the_others_are_untouched() -> None:
    cluster, clock = _FakeCluster(["prefill-0", "decode-0"]), _Clock()
    supervisor = _supervisor(cluster, clock, health_interval_s=100.0)
    supervisor.tick()  # first probes
    cluster.events.clear()
    cluster.current["decode-0"].returncode = -9
    clock.now = 10.0
    supervisor.tick()
    clock.now = 10.9
    supervisor.tick()
    assert cluster.events == []  # waiting out the 1 s backoff
    clock.now = 11.0
    cluster.ready["decode-0"] = False
    supervisor.tick()
    assert cluster.events == [("respawn", "decode-0")]
    assert cluster.current["decode-0"].pid == 101
    cluster.ready["decode-0"] = True
    clock.now = 11.5
    supervisor.tick()  # ready: probed from the next health interval on
    assert cluster.events == [("respawn", "decode-0")]


def test_a_crash_loop_is_given_up_on_with_the_childs_name_status_and_log() -> None:
    cluster, clock = _FakeCluster(["decode-0"]), _Clock()
    supervisor = _supervisor(cluster, clock)
    for restart_at in (1.0, 3.0):  # backoff 1 s, then 2 s
        cluster.current["decode-0"].returncode = 1
        supervisor.tick()
        clock.now = restart_at
        supervisor.tick()
    assert cluster.events == [("respawn", "decode-0"), ("respawn", "decode-0")]
    cluster.current["decode-0"].returncode = 1
    with pytest.raises(GaveUp) as caught:
        supervisor.tick()
    assert str(caught.value) == (
        "decode-0 exited with status 1 (2 restarts within 60 s already); giving up: fix the cause its log ends with "
        "(below), or allow more with --max-restarts / --restart-window\n    | last words of decode-0"
    )


def test_a_child_not_serving_past_the_threshold_is_killed_then_restarted() -> None:
    cluster, clock = _FakeCluster(["decode-0"]), _Clock()
    supervisor = _supervisor(cluster, clock)
    cluster.serving["decode-0"] = False
    for now in (0.0, 1.0, 2.0):  # unhealthy since 0 s: not yet 3 s
        clock.now = now
        supervisor.tick()
    assert ("kill", "decode-0") not in cluster.events
    cluster.serving["decode-0"] = True  # recovers: the count starts over
    clock.now = 3.0
    supervisor.tick()
    cluster.serving["decode-0"] = False
    for now in (4.0, 5.0, 6.0, 7.0):
        clock.now = now
        supervisor.tick()
    assert cluster.events[-2:] == [("probe", "decode-0"), ("kill", "decode-0")]
    clock.now = 7.5
    supervisor.tick()  # sees the exit of the killed process
    clock.now = 8.5
    supervisor.tick()
    assert cluster.events[-1] == ("respawn", "decode-0")
