"""When an engine holds its next step back for requests on their way: scheduling policy.

Two rules, both off with ``window_s=0``:

- **A burst's first step.** An engine that was idle and now has prompts to
  compute takes the requests arriving right behind them before its first step,
  so that a burst starts as one batch (as ``LLM.generate``'s does). It waits
  while they keep coming (each within ``arrival_gap_s`` of the last), for at
  most ``window_s``, and not once the first step is full. Without it a burst's
  first request is prefilled alone, and then decodes alone on its decode
  worker, one step's weight reads per token, while the rest of the burst
  computes.
- **Requests that land together.** A prefill step's requests finish together,
  so their pushed KV lands here together, but their starts arrive
  milliseconds apart. Before a step, the engine holds while pushed KV that has
  fully landed waits for its request: without the hold, the first start's step
  runs without the rest, which get their second tokens a step later and cost
  one more step's weight reads. Each request that joins this step rather than
  the next gets its second token a step sooner; each stream running here waits
  as long as the hold lasts. So a busy engine holds only while that is the
  better bargain (at most the last step's time x the requests on their way /
  the streams of the last step, never over ``window_s``); an idle one, which
  holds nobody up, up to ``window_s``. A push counts as on its way for
  ``window_s`` after it landed, so one whose request went elsewhere stops
  holding steps then.

The policy only says how long to wait; the thread that drives the engine
(``AsyncEngine``) waits, running the commands that arrive meanwhile. Nothing
runs during the wait, so no stream is held up by more than the hold.
``benchmarks/cluster_throughput.py`` measures both rules' effect on a cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

# How long an engine gathering a burst waits for the next request. Requests sent at once reach a prefill
# worker through the gateway about a millisecond apart (0.2-1.7 ms, now and then 2.3-4.9 ms among the first
# few, in cluster_throughput's step traces), so a 3 ms gap still left a burst's first step with one request.
ARRIVAL_GAP_S = 0.005


class BatchWindow:
    """How long to hold the next step for requests on their way (module docstring); 0 s: never."""

    def __init__(self, window_s: float = 0.0, arrival_gap_s: float = ARRIVAL_GAP_S) -> None:
        if window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0, got {window_s}")
        if arrival_gap_s <= 0:
            raise ValueError(f"arrival_gap_s must be positive, got {arrival_gap_s}")
        self.window_s = window_s
        self.arrival_gap_s = arrival_gap_s
        # The last step's wall time and how many requests it gave an output.
        self._last_step_s, self._last_step_streams = 0.0, 0

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    def step_ran(self, seconds: float, num_streams: int) -> None:
        """Record a step's wall time and how many requests got an output in it (the hold's price)."""
        self._last_step_s, self._last_step_streams = seconds, num_streams

    def arrival_wait_s(self, engine: LLMEngine, deadline: float, now: float) -> float:
        """An idle engine about to start a burst: how long to wait for the next request (0: step now).
        ``deadline``: ``window_s`` after the engine stopped being idle."""
        if not engine.next_step_has_room_for_prompts():
            return 0.0
        return max(0.0, min(self.arrival_gap_s, deadline - now))

    def landing_wait_s(self, engine: LLMEngine, busy: bool, held_since: float, now: float) -> float:
        """How much longer to hold the step (0: step now) while landed pushes wait for their requests.
        ``busy``: streams run here (their tokens wait while it holds); ``held_since``: when the hold began."""
        arriving = engine.kv_connector.pushes_landed_since(now - self.window_s)
        if not arriving:
            return 0.0
        streams = max(1, self._last_step_streams) if busy else 0
        limit = min(self.window_s, self._last_step_s * arriving / streams) if streams else self.window_s
        return max(0.0, held_since + limit - now)
