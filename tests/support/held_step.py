"""An engine step a test holds: the engine thread stops inside it until the test lets it go."""

from __future__ import annotations

import threading

from pdserve.engine import LLMEngine


class HeldStep:
    """Wraps ``engine.step``: once ``armed``, the next step waits for ``release``, then raises ``failure`` (if given)
    or runs. ``entered`` is set when the engine thread is inside it."""

    def __init__(self, engine: LLMEngine, failure: BaseException | None = None) -> None:
        self.step = engine.step
        self.failure = failure
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()
        engine.step = self  # type: ignore[method-assign]

    def __call__(self):  # noqa: ANN204
        if self.armed.is_set():
            self.armed.clear()
            self.entered.set()
            self.release.wait(timeout=30)
            if self.failure is not None:
                raise self.failure
        return self.step()
