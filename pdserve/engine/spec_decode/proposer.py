"""The one interface every proposer implements, and the n-gram (prompt lookup) proposer."""

from __future__ import annotations

import abc
import array
from collections.abc import Sequence as Seq

from pdserve.engine.sequence import Sequence

_ITEM = array.array("i").itemsize


class Proposer(abc.ABC):
    """Guesses the next tokens of running sequences; the target model verifies them.

    A proposal only changes how fast a request runs, never what it produces:
    the verifier keeps a proposed token only where the target would have chosen
    it. Proposals must be deterministic functions of what the proposer saw, so
    that a seeded request's acceptance does not depend on the batch.
    """

    @abc.abstractmethod
    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[list[int]]:
        """For each sequence (decoding, its last token sampled but not computed yet), at most
        ``max_tokens[i]`` proposed continuation tokens; an empty list when it has no guess."""

    def catches_up(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> bool:
        """Whether proposing for ``seqs`` also does one-off work (a draft filling its KV over a prompt),
        so that its time says nothing about what speculating costs per step."""
        return False


class NgramProposer(Proposer):
    """Prompt lookup decoding: the tokens that followed the latest earlier occurrence of the sequence's suffix.

    Suffixes are tried from ``max_n`` tokens down to ``min_n``; the first (longest)
    one found anywhere earlier in the prompt or output wins, at its latest
    occurrence. Searching is a byte search over the token ids packed as int32,
    which keeps a step's lookups off the Python interpreter.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[list[int]]:
        return [ngram_lookup(seq.token_ids, self.min_n, self.max_n, k) for seq, k in zip(seqs, max_tokens)]


def ngram_lookup(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """At most ``k`` tokens following the latest earlier match of the longest suffix of ``token_ids``
    of ``max_n`` down to ``min_n`` tokens (the suffix itself excluded)."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return []
    data = array.array("i", token_ids).tobytes()
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = data[(num_tokens - n) * _ITEM :]
        # Latest occurrence that starts before the suffix itself, on an int32 boundary.
        # A match must end at least one token before the sequence does (it may overlap the suffix).
        end = (num_tokens - 1) * _ITEM
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % _ITEM == 0:
                start = at // _ITEM + n  # first token after the match
                return token_ids[start : start + k]
            end = at + len(suffix) - 1  # misaligned: look for one that starts earlier
    return []
