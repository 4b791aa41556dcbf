"""``BatchWindow``: how long an engine holds its next step for requests on their way (pure decisions)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine.batch_window import ARRIVAL_GAP_S, BatchWindow


def _engine(room_for_prompts: bool = True, landed: dict[float, int] | None = None) -> SimpleNamespace:
    """The two things the policy reads: whether prompts wait with room in the next step, and how many pushes
    landed since a time (``landed``: a landing time -> pushes)."""
    landed = landed or {}

    def pushes_landed_since(since: float) -> int:
        return sum(count for at, count in landed.items() if at >= since)

    return SimpleNamespace(next_step_has_room_for_prompts=lambda: room_for_prompts,
                           kv_connector=SimpleNamespace(pushes_landed_since=pushes_landed_since))


def test_an_idle_engine_waits_one_arrival_gap_at_a_time_until_the_window_ends() -> None:
    window = BatchWindow(0.030)
    assert window.arrival_wait_s(_engine(), deadline=10.030, now=10.0) == ARRIVAL_GAP_S == 0.005
    assert window.arrival_wait_s(_engine(), deadline=10.030, now=10.028) == pytest.approx(0.002)
    assert window.arrival_wait_s(_engine(), deadline=10.030, now=10.031) == 0.0
    # The first step is full (or only remote KV waits): step now.
    assert window.arrival_wait_s(_engine(room_for_prompts=False), deadline=10.030, now=10.0) == 0.0


def test_an_idle_engine_holds_for_a_landed_push_up_to_the_window() -> None:
    window = BatchWindow(0.5)
    engine = _engine(landed={9.8: 1})
    assert window.landing_wait_s(engine, busy=False, held_since=10.0, now=10.0) == pytest.approx(0.5)
    assert window.landing_wait_s(engine, busy=False, held_since=10.0, now=10.2) == pytest.approx(0.3)
    # A push counts as on its way for the window after it landed: this one no longer at 10.3 and later.
    assert window.landing_wait_s(engine, busy=False, held_since=10.0, now=10.31) == 0.0


def test_a_busy_engine_holds_for_the_last_step_times_arriving_over_streams_never_past_the_window() -> None:
    window = BatchWindow(1.0)
    window.step_ran(0.6, 3)  # three streams got a token in a 0.6 s step
    one, two = _engine(landed={10.0: 1}), _engine(landed={10.0: 2})
    assert window.landing_wait_s(one, busy=True, held_since=10.0, now=10.0) == pytest.approx(0.2)
    assert window.landing_wait_s(two, busy=True, held_since=10.0, now=10.1) == pytest.approx(0.3)
    window.step_ran(3.0, 1)
    assert window.landing_wait_s(one, busy=True, held_since=10.0, now=10.0) == pytest.approx(1.0)
    # Nothing on its way: no hold.
    assert window.landing_wait_s(_engine(), busy=True, held_since=10.0, now=10.0) == 0.0


def test_a_window_of_zero_is_off_and_a_negative_one_is_refused() -> None:
    assert not BatchWindow().enabled and BatchWindow(0.001).enabled
    with pytest.raises(ValueError, match="batch_window_s must be >= 0, got -1"):
        BatchWindow(-1)
    with pytest.raises(ValueError, match="arrival_gap_s must be positive, got 0"):
        BatchWindow(1.0, arrival_gap_s=0)
