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

    def start(self, matchers: Sequence[tuple[int, Any]]) -> Future[tuple[list[int], torch.Tensor]]:
        """``matchers``: (row, matcher) pairs. The future's result: the rows and their (rows, words) masks."""
        return self._executor.submit(self.fill, matchers)

    def fill(self, matchers: Sequence[tuple[int, Any]]) -> tuple[list[int], torch.Tensor]:
        masks = torch.zeros((len(matchers), self._words), dtype=torch.int32)
        stride = self._words * 4
        for index, (_, matcher) in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(masks.data_ptr() + index * stride, stride)
        return [row for row, _ in matchers], masks

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
