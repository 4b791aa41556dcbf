"""Proposers with known answers, so that tests control exactly which proposed tokens are right."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.proposer import Proposer


class ScriptedProposer(Proposer):
    """Proposes each request's known continuation, wrong at every output index in ``wrong_at``.

    ``continuations`` maps a prompt (as a tuple) to the tokens plain decoding
    produces for it; a wrong token is the right one plus one (mod ``vocab_size``).
    """

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong_at: set[int], vocab_size: int) -> None:
        self.continuations = continuations
        self.wrong_at = wrong_at
        self.vocab_size = vocab_size
        self.calls: list[tuple[str, int, list[int]]] = []  # (request id, output length, proposal)

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[list[int]]:
        proposals = []
        for seq, k in zip(seqs, max_tokens):
            reference = self.continuations[tuple(seq.prompt_token_ids)]
            done = seq.num_output_tokens
            proposal = [
                (token + 1) % self.vocab_size if done + j in self.wrong_at else token
                for j, token in enumerate(reference[done : done + k])
            ]
            self.calls.append((seq.request_id, done, proposal))
            proposals.append(proposal)
        return proposals
