"""Per-request logit adjustments: min_tokens, logit_bias and the three penalties, batched.

They run before the sampler chooses, in vLLM's order (v1 ``Sampler``: the
processors that can change the argmax, min_tokens then logit_bias, then the
penalties: repetition, frequency, presence), which is also the order
transformers' ``generate`` applies ``sequence_bias`` and ``repetition_penalty``.
Only the rows whose ``SamplingParams.adjusts_logits`` is true are touched; a
batch without such a row never reaches this module.
"""

from __future__ import annotations

import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.types.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """The tokens a row's penalties read: its prompt and output, as one list (not copied)."""

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def adjust_logits_(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None] | None,
    eos_token_ids: Collection[int],
) -> None:
    """Apply each asking row's adjustments to ``logits`` (num_seqs, vocab_size) float32, in place.

    Only those rows are read and written: the cost follows the rows that ask,
    not the batch. ``histories[i]`` may be None (or ``histories`` itself) where
    no row adjusts.
    """
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return
    device = logits.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    sub_params = [params[i] for i in rows]
    sub_histories = []
    for i in rows:
        history = histories[i] if histories is not None else None
        if history is None:
            raise ValueError(f"row {i} adjusts its logits and needs its token history")
        sub_histories.append(history)
    adjusted = logits.index_select(0, row_index)  # (num_rows, vocab_size), a copy
    _mask_stop_tokens_before_min_tokens(adjusted, sub_params, sub_histories, eos_token_ids)
    _add_logit_bias(adjusted, sub_params)
    _apply_repetition_penalty(adjusted, sub_params, sub_histories)
    _apply_frequency_and_presence_penalties(adjusted, sub_params, sub_histories)
    logits.index_copy_(0, row_index, adjusted)


def _mask_stop_tokens_before_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    eos_token_ids: Collection[int],
) -> None:
    vocab_size = logits.shape[1]
    mask_rows: list[int] = []
    mask_tokens: list[int] = []
    for row, (p, history) in enumerate(zip(params, histories)):
        if history.num_output_tokens >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
        # An id past the vocabulary can never be sampled: nothing to mask.
        in_vocab = sorted(t for t in stop_ids if t < vocab_size)
        mask_rows.extend([row] * len(in_vocab))
        mask_tokens.extend(in_vocab)
    if mask_rows:
        index = _index_pair(mask_rows, mask_tokens, logits.device)
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


def _add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            bias_rows.append(row)
            bias_tokens.append(token_id)
            bias_values.append(bias)
    if bias_rows:
        values = torch.tensor(bias_values, dtype=torch.float32, device=logits.device)
        # Token ids are unique per row (SamplingParams checks), so accumulating adds each bias once.
        logits.index_put_(_index_pair(bias_rows, bias_tokens, logits.device), values, accumulate=True)


def _apply_repetition_penalty(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> None:
    rows = [row for row, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return
    device = logits.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    # Prompt and output alike (the CTRL paper, transformers and vLLM). Only the
    # seen tokens are read and written: the cost follows the history, not the vocabulary.
    token_ids = _padded([histories[row].token_ids for row in rows], device)  # (num_rows, longest)
    penalties = torch.tensor([params[row].repetition_penalty for row in rows], dtype=torch.float32, device=device)
    penalties = penalties.unsqueeze(1)  # (num_rows, 1)
    part = logits.index_select(0, row_index)  # (num_rows, vocab_size)
    seen = part.gather(1, token_ids)  # (num_rows, longest)
    # Dividing a positive logit and multiplying a negative one both make the token less likely.
    seen = torch.where(seen > 0, seen / penalties, seen * penalties)
    # A token seen twice is written twice with the same value.
    part.scatter_(1, token_ids, seen)
    logits.index_copy_(0, row_index, part)


def _apply_frequency_and_presence_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> None:
    rows = [
        row
        for row, p in enumerate(params)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and histories[row].num_output_tokens > 0
    ]
    if not rows:
        return
    device = logits.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    # The output only: OpenAI's definition, and vLLM's.
    outputs = [histories[row].token_ids[histories[row].num_prompt_tokens :] for row in rows]
    counts = _token_counts(outputs, logits.shape[1], device)  # (num_rows, vocab_size) float32
    frequency = torch.tensor([params[row].frequency_penalty for row in rows], dtype=torch.float32, device=device)
    presence = torch.tensor([params[row].presence_penalty for row in rows], dtype=torch.float32, device=device)
    part = logits.index_select(0, row_index)
    part -= frequency.unsqueeze(1) * counts
    part -= presence.unsqueeze(1) * (counts > 0).float()
    logits.index_copy_(0, row_index, part)


def _token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(len(token_lists), vocab_size) float32: how often each token occurs in each list (each non-empty)."""
    padded = _padded(token_lists, device)
    # Padding repeats a row's first token: counted into an extra column instead.
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device).unsqueeze(1)
    is_padding = torch.arange(padded.shape[1], device=device).unsqueeze(0) >= lengths
    padded = padded.masked_fill(is_padding, vocab_size)
    counts = torch.zeros((len(token_lists), vocab_size + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _padded(token_lists: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """(len(token_lists), longest) int64 of non-empty lists, each padded with its own first token."""
    longest = max(len(tokens) for tokens in token_lists)
    padded = torch.empty((len(token_lists), longest), dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        # Through array.array: several times faster than torch.tensor on a list of
        # ints, and a history is converted every step.
        padded[row, : len(tokens)] = torch.frombuffer(array.array("q", tokens), dtype=torch.long)
        padded[row, len(tokens) :] = tokens[0]
    return padded.to(device)


def _index_pair(rows: list[int], tokens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
    )
