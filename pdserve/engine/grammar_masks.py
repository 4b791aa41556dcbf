"""The token masks of a step's constrained rows (``engine.structured_output``), applied to the logits."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch


class GrammarMasks:
    """The token masks of one step's constrained rows, filled on a thread while the forward runs.

    ``start`` takes each constrained row's matcher (in its state before the step's token) and begins
    filling; ``apply`` waits for the masks and sets every disallowed logit of those rows to -inf."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-mask")

    def start(self, matchers: Sequence[tuple[int, Any, Sequence[int]]]) -> Future[tuple[list[int], torch.Tensor]]:
        """``matchers``: (first row, matcher, proposed tokens) triples. The future's result: the rows and their
        (rows, words) masks: a sequence verifying ``k`` proposed tokens has ``1 + k`` rows (``fill``)."""
        return self._executor.submit(self.fill, matchers)

    def fill(self, matchers: Sequence[tuple[int, Any, Sequence[int]]]) -> tuple[list[int], torch.Tensor]:
        """Each matcher's mask at its row; with proposed tokens, row ``first + j`` gets the mask after the first
        ``j`` of them (the matcher advances through them, then rolls back to where it was). Past a proposed token
        the grammar refuses, the rows repeat the last mask: the target's masked sample there cannot equal the
        refused token, so nothing after it is accepted."""
        rows = [first + j for first, _, proposed in matchers for j in range(1 + len(proposed))]
        masks = torch.zeros((len(rows), self._words), dtype=torch.int32)
        stride = self._words * 4
        index = 0
        for _, matcher, proposed in matchers:
            consumed = 0
            allowed = True  # every proposed token so far was
            for j in range(1 + len(proposed)):
                if allowed:
                    matcher.unsafe_compute_mask_ptr(masks.data_ptr() + index * stride, stride)
                    if j < len(proposed):
                        allowed = matcher.try_consume_tokens([proposed[j]]) == 1
                        consumed += allowed
                else:
                    masks[index] = masks[index - 1]
                index += 1
            if consumed:
                matcher.rollback(consumed)
        return rows, masks

    @staticmethod
    def allowed(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(rows, vocab_size) bool: bit ``t % 32`` of word ``t // 32`` of each row, as llguidance lays it out."""
        as_bytes = masks.numpy().view(np.uint8)
        bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits.astype(np.bool_))

    def apply(self, logits: torch.Tensor, pending: Future[tuple[list[int], torch.Tensor]]) -> None:
        """Set the disallowed logits of the constrained rows to -inf, in place."""
        rows, masks = pending.result()
        allowed = self.allowed(masks, self.vocab_size).to(logits.device)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        constrained = logits.index_select(0, index)
        logits.index_copy_(0, index, constrained.masked_fill_(~allowed, float("-inf")))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
