"""Perplexity, top-1 agreement and KL per token, from what ``prompt_logprobs`` returns.

Pure Python over plain numbers, so the math is tested on hand-made sequences.

**Windows.** A text of ``n`` tokens is cut into windows of ``window`` tokens whose
starts are ``stride`` apart (the sliding-window method of Hugging Face's
perplexity guide). Every token is scored at most once: by the first window
that holds it as a predicted token (not as the window's first token, which has
no context in it), so after the first window each window scores only the tokens
past the previous window's end, with at least ``window - stride`` tokens of
context. With ``stride < window`` every token but the text's first is scored;
with ``stride == window`` (no overlap) every window's first token is not.

**KL per token.** ``prompt_logprobs=N`` returns each position's N most likely
tokens, not the full distribution. The KL reported is KL(P‖Q), P the float32
reference and Q the setting under test, over a coarser partition of the
vocabulary: every token in *both* top-N lists on its own, plus one bucket for
all other tokens (mass ``1 − Σ`` of the listed ones, on each side). P and Q are
both known exactly on that partition, and merging outcomes never increases KL
(log-sum inequality), so the figure is a lower bound on the full KL, close to it
where the listed tokens carry most of P's mass; ``mean_coverage`` reports how
much of P's mass they carry, on average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence as Seq

# Below this, a bucket's mass is rounding error of the listed probabilities' sum.
MASS_EPSILON = 1e-9

TopList = Seq[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` of the text; the entries for tokens ``[first_scored, end)`` count."""

    begin: int
    end: int
    first_scored: int

    @property
    def num_scored(self) -> int:
        return self.end - self.first_scored

    def scored_entries(self) -> range:
        """Indices into this window's ``prompt_logprobs``: entry ``j`` is the logprob of token ``begin + j + 1``."""
        return range(self.first_scored - self.begin - 1, self.end - self.begin - 1)


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows covering ``num_tokens`` tokens, each token scored at most once."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text needs at least 2 tokens, got {num_tokens}")
    windows = []
    begin, scored_up_to = 0, 1  # token 0 has no context and is never scored
    while True:
        end = min(begin + window, num_tokens)
        # A window's own first token has no context in it: with stride == window it goes unscored.
        first_scored = max(scored_up_to, begin + 1)
        if end > first_scored:
            windows.append(Window(begin, end, first_scored))
            scored_up_to = end
        if end == num_tokens:
            return windows
        begin += stride


def perplexity(logprobs: Seq[float]) -> float:
    """exp of the mean negative log-likelihood per token."""
    if not logprobs:
        raise ValueError("perplexity of no tokens")
    return math.exp(-math.fsum(logprobs) / len(logprobs))


def top1_agreement(reference: Seq[TopList], candidate: Seq[TopList]) -> float:
    """Share of positions where both put the same token first."""
    _check_aligned(reference, candidate)
    same = sum(ref[0][0] == cand[0][0] for ref, cand in zip(reference, candidate))
    return same / len(reference)


def truncated_kl(reference: TopList, candidate: TopList) -> tuple[float, float]:
    """(KL(P‖Q) over the tokens in both lists plus one bucket for the rest, P's mass on those tokens)."""
    candidate_logprobs = dict(candidate)
    kl = 0.0
    shared_p = shared_q = 0.0
    for token_id, ref_logprob in reference:
        cand_logprob = candidate_logprobs.get(token_id)
        if cand_logprob is None:
            continue
        p = math.exp(ref_logprob)
        kl += p * (ref_logprob - cand_logprob)
        shared_p += p
        shared_q += math.exp(cand_logprob)
    rest_p = 1.0 - shared_p
    rest_q = 1.0 - shared_q
    if rest_p > MASS_EPSILON:
        kl += rest_p * math.log(rest_p / max(rest_q, MASS_EPSILON))
    return kl, shared_p


@dataclass(frozen=True)
class Agreement:
    """How a setting's distributions compare with the reference's, position by position."""

    top1_agreement: float
    mean_kl: float
    mean_coverage: float


def agreement(reference: Seq[TopList], candidate: Seq[TopList]) -> Agreement:
    _check_aligned(reference, candidate)
    kls, coverages = zip(*(truncated_kl(ref, cand) for ref, cand in zip(reference, candidate)))
    return Agreement(
        top1_agreement=top1_agreement(reference, candidate),
        mean_kl=math.fsum(kls) / len(kls),
        mean_coverage=math.fsum(coverages) / len(coverages),
    )


def _check_aligned(reference: Seq[TopList], candidate: Seq[TopList]) -> None:
    if len(reference) != len(candidate):
        raise ValueError(f"reference has {len(reference)} positions, candidate {len(candidate)}")
    if not reference:
        raise ValueError("no positions to compare")
    if any(not top for top in reference) or any(not top for top in candidate):
        raise ValueError("every position needs a top list: request prompt_logprobs >= 1")
