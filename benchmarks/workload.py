"""The benchmark's workload and what each system hands back for it.

Every system is given the same ``Workload`` object, so the prompts, their order
and the output length are identical by construction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numpy as np

from pdserve.bench.workload import LOWEST_ORDINARY_TOKEN_ID  # SmolLM2's special tokens are 0..16

T = TypeVar("T")


@dataclass(frozen=True)
class Workload:
    """Prompts of random token ids and how many tokens to generate for each."""

    prompts: tuple[tuple[int, ...], ...]
    output_len: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def mean_prompt_len(self) -> float:
        return self.num_prompt_tokens / len(self.prompts)

    def prompt_lists(self) -> list[list[int]]:
        return [list(prompt) for prompt in self.prompts]


def make_workload(
    num_prompts: int, min_len: int, max_len: int, output_len: int, vocab_size: int, seed: int
) -> Workload:
    """``num_prompts`` prompts with lengths uniform in ``[min_len, max_len]`` and ids uniform over ordinary tokens."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num_prompts)
    prompts = tuple(
        tuple(int(t) for t in rng.integers(LOWEST_ORDINARY_TOKEN_ID, vocab_size, size=int(n))) for n in lengths
    )
    return Workload(prompts=prompts, output_len=output_len)


def make_warmup_workload(workload: Workload, vocab_size: int, seed: int) -> Workload:
    """Two short prompts, drawn from a stream separate from the workload's so they share no prefix with it."""
    rng = np.random.default_rng([seed, 1])
    length = min(len(p) for p in workload.prompts)
    prompts = tuple(
        tuple(int(t) for t in rng.integers(LOWEST_ORDINARY_TOKEN_ID, vocab_size, size=length)) for _ in range(2)
    )
    return Workload(prompts=prompts, output_len=min(4, workload.output_len))


@dataclass(frozen=True)
class RunResult:
    """One system's timed pass over the workload; ``token_ids`` holds each prompt's generated ids, in prompt order."""

    name: str
    wall_s: float
    token_ids: tuple[tuple[int, ...], ...]
    # Model load and engine construction, kept out of ``wall_s``.
    setup_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    def summary(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "output_tokens": self.num_output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "setup_s": self.setup_s,
            **self.details,
        }


@dataclass(frozen=True)
class Agreement:
    """How often two systems' greedy outputs are identical, and how far they agree before diverging."""

    num_prompts: int
    num_identical: int
    # Mean over prompts of (tokens before the first difference) / (tokens compared).
    mean_common_prefix_fraction: float

    @property
    def identical_fraction(self) -> float:
        return self.num_identical / self.num_prompts

    def summary(self) -> dict[str, Any]:
        return {
            "identical_fraction": self.identical_fraction,
            "num_identical": self.num_identical,
            "num_prompts": self.num_prompts,
            "mean_common_prefix_fraction": self.mean_common_prefix_fraction,
        }


def compare_outputs(first: RunResult, second: RunResult) -> Agreement:
    if len(first.token_ids) != len(second.token_ids):
        raise ValueError(f"{first.name} and {second.name} answered different numbers of prompts")
    identical = 0
    prefix_fractions = []
    for a, b in zip(first.token_ids, second.token_ids):
        identical += a == b
        compared = max(len(a), len(b))
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix_fractions.append(common / compared if compared else 1.0)
    return Agreement(
        num_prompts=len(first.token_ids),
        num_identical=identical,
        mean_common_prefix_fraction=float(np.mean(prefix_fractions)),
    )


def timed(run: Callable[[], T]) -> tuple[T, float]:
    """``run()``'s result and its wall time in seconds."""
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start
