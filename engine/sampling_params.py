"""Per-request sampling parameters, validated where they are built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


_GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Names and defaults follow vLLM's ``SamplingParams`` so users can move code
    between the two. ``temperature == 0`` means greedy. ``top_k == -1`` and
    ``top_p == 1`` disable those filters. ``logprobs=N`` returns, for every
    generated token, its own log-probability and the ``N`` most likely tokens
    under the raw (untempered, unfiltered) model distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or self.logprobs < 0
        ):
            raise ValueError(f"logprobs must be a non-negative integer or None, got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows float32 to NaN;
        # the distribution is a point mass on the argmax anyway (vLLM does the same).
        return self.temperature < _GREEDY_BELOW
