"""An engine's steps as a test sees them: per step, how many requests it had and which ones it gave an output."""

from __future__ import annotations

import time

from pdserve.engine import LLMEngine


class StepLog:
    """Wraps ``engine.step``: ``steps`` gets, per step in order, the engine's running and waiting requests before it
    and the sorted ids of those it gave an output. Each step first sleeps ``sleep_s`` (0: none), for a step as long
    as a real model's where a test's bounds are measured against it."""

    def __init__(self, engine: LLMEngine, sleep_s: float = 0.0) -> None:
        self.engine = engine
        self.step = engine.step
        self.sleep_s = sleep_s
        self.steps: list[tuple[int, list[str]]] = []
        engine.step = self  # type: ignore[method-assign]

    def __call__(self):  # noqa: ANN204
        if self.sleep_s:
            time.sleep(self.sleep_s)
        stats = self.engine.stats()
        outputs = self.step()
        self.steps.append((stats.num_running + stats.num_waiting, sorted(output.request_id for output in outputs)))
        return outputs

    def first_step_of(self, request_id: str) -> int:
        """The index of the first step that gave ``request_id`` an output."""
        return next(i for i, (_, ids) in enumerate(self.steps) if request_id in ids)
