"""Scheduler unit-test helpers: a step with no model, and what a step scheduled."""

from __future__ import annotations

from pdserve.engine.scheduler import Scheduler, SchedulerOutput


def fake_step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule, 'run' the step, and append token 1000 to every sequence that samples."""
    out = scheduler.schedule()
    scheduler.complete_step(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.append_token(1000)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, first token, number of tokens) of each scheduled sequence, in order."""
    return [(item.seq.request_id, item.start, item.num_new_tokens) for item in out.scheduled]
