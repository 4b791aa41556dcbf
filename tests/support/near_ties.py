"""The near-tie rule of the comparisons with a reference: where the reference's top two logits are closer than a
margin, another rounding may pick the other token, so a difference there says nothing about the path under test;
everywhere else the tokens must agree.

Two forms: greedy sequences (``comparable``: compare up to the first near-tie, as the tensor-parallel tests
do, whose ranks sum partial products in another order) and teacher-forced top-1 agreement over every prompt
position (``decisive_agreement``: the share of decisive positions where the top tokens agree, for settings
whose rounding differs by design: bf16, INT8/INT4 weights, compact KV caches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine import RequestOutput

# A greedy step whose top-2 logits (in the reference run) are closer than this may flip when
# the ranks sum partial products in another order; the comparison stops before such a step.
TIE_MARGIN = 1e-4


def comparable(tokens: list[int], margins: list[float], margin: float = TIE_MARGIN) -> int:
    """How many leading tokens must match exactly: all, or up to the first near-tie (reference margin < ``margin``)."""
    for i, gap in enumerate(margins[: len(tokens)]):
        if gap < margin:
            return i
    return len(tokens)


@dataclass(frozen=True)
class TopTwo:
    """Each position's most likely token and its logit's lead over the second (a logprob difference, the same)."""

    tokens: tuple[int, ...]
    margins: tuple[float, ...]


def prompt_top_two(outputs: Sequence[RequestOutput], skip: int = 0) -> TopTwo:
    """The top two of every prompt position (``prompt_logprobs`` of at least 2) after the first ``skip`` of each
    prompt, prompts in order."""
    entries = [entry for out in outputs for entry in (out.prompt_logprobs or [])[skip:]]
    assert all(len(entry.top) >= 2 for entry in entries), "prompt_logprobs must be 2 or more"
    return TopTwo(
        tuple(entry.top[0][0] for entry in entries), tuple(entry.top[0][1] - entry.top[1][1] for entry in entries)
    )


@dataclass(frozen=True)
class Agreement:
    """Top-1 agreement over the positions the reference decides by at least ``margin``."""

    agreeing: int
    counted: int
    positions: int
    margin: float

    @property
    def share(self) -> float:
        return self.agreeing / self.counted

    def __str__(self) -> str:
        return (f"{self.share:.3f} of the {self.counted} positions (of {self.positions}) the reference decides by "
                f">= {self.margin}: {self.counted - self.agreeing} disagree")


def decisive_agreement(reference: TopTwo, candidate: TopTwo, margin: float) -> Agreement:
    """How often ``candidate``'s top token is the reference's, where the reference's lead is ``margin`` or more."""
    assert len(reference.tokens) == len(candidate.tokens) > 0
    counted = [i for i, lead in enumerate(reference.margins) if lead >= margin]
    agreeing = sum(reference.tokens[i] == candidate.tokens[i] for i in counted)
    return Agreement(agreeing, len(counted), len(reference.tokens), margin)
