"""The LM head split by vocabulary over the tensor-parallel ranks, for the rows a decode step samples.

Each rank keeps the head's rows (vocabulary entries) in its ``vocab_range``.
At a step that samples at most ``SPLIT_LM_HEAD_MAX_ROWS`` rows, every rank
multiplies those rows of the final hidden state (the same bits on every rank,
after the last all-reduce) by its part, and rank 0 receives the other parts in
vocabulary order and joins them: each rank does 1/N of the largest matmul of a
decode step, for one small receive per rank (benchmarks/tensor_parallel.py; BENCHMARKS.md).

With many rows (prompt logprobs compute every prompt row; a batch sampling
hundreds of sequences) moving (rows, vocab / N) logits costs more than the
matmul saves, so rank 0 keeps the rest of the head too and computes those
logits alone, as a replicated head would; the other ranks keep only their
part. Rank 0's two parts are views of the loaded head, packed once each, so it
holds what it held with a replicated head and the other ranks hold 1/N of it.

The embedding lookup stays replicated: it reads one row per token and does no
arithmetic, while a split lookup would add an all-reduce of (tokens, hidden)
to every step; a tied head's parts are views of that embedding (no copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.layers.linear import PackedLinear

if TYPE_CHECKING:
    from pdserve.engine.parallel.group import TensorParallelGroup

# Sampled rows up to which a step splits the LM head over the ranks; above it rank 0 computes the
# logits alone (the crossover measured by benchmarks/tensor_parallel.py; BENCHMARKS.md).
SPLIT_LM_HEAD_MAX_ROWS = 64
_LOGITS_TAG = 8


def vocab_range(vocab_size: int, tensor_parallel_size: int, rank: int) -> range:
    """The vocabulary entries (head rows) rank ``rank`` keeps: contiguous, in rank order; when ``tp`` does not
    divide ``vocab_size`` the first ``vocab_size % tp`` ranks keep one more."""
    tp = tensor_parallel_size
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    base, extra = divmod(vocab_size, tp)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def uses_split_head(num_sampled_rows: int) -> bool:
    """Whether a step sampling this many rows computes its logits over every rank's part."""
    return 0 < num_sampled_rows <= SPLIT_LM_HEAD_MAX_ROWS


def shard_lm_head(model: nn.Module, rank: int, tensor_parallel_size: int) -> None:
    """Before packing: keep this rank's part as ``model.lm_head``; rank 0 also keeps the rest, packed,
    as ``model.lm_head_rest`` (``install_split_head`` joins the two once the model is packed)."""
    head = model.lm_head
    weight = head.weight.detach()  # (vocab, hidden); a tied head's is the embedding's tensor
    tied = head.weight is model.model.embed_tokens.weight
    own = vocab_range(weight.shape[0], tensor_parallel_size, rank)
    rows = weight[own.start : own.stop]
    # A view keeps the whole tensor alive: right for rank 0 (its rest is the other view) and for a tied
    # head (the embedding stays anyway); another rank's untied part is copied so the full head is freed.
    head.weight = nn.Parameter(rows if rank == 0 or tied else rows.clone(), requires_grad=False)
    head.out_features = len(own)
    if rank == 0:
        model.lm_head_rest = PackedLinear([linear_over(weight[own.stop :])])


def install_split_head(model: nn.Module) -> None:
    """Rank 0, after packing: ``compute_logits`` gives the whole vocabulary from its two parts."""
    model.lm_head_packed = VocabSplitHead(model.lm_head_packed, model.lm_head_rest)
    del model.lm_head_rest


class VocabSplitHead(nn.Module):
    """Rank 0's LM head: its own vocabulary part (``own``) and the other ranks' (``rest``), each packed."""

    def __init__(self, own: PackedLinear, rest: PackedLinear) -> None:
        super().__init__()
        self.own = own
        self.rest = rest

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, hidden) -> (rows, vocab)
        return torch.cat((self.own(x), self.rest(x)), dim=1)


def gather_split_logits(
    head: VocabSplitHead, hidden_rows: torch.Tensor, group: TensorParallelGroup, comm_device: torch.device
) -> torch.Tensor:  # (rows, hidden) -> (rows, vocab)
    """Rank 0's half of a split head: its part's logits joined with every other rank's, in vocabulary order."""
    parts = [head.own(hidden_rows)]  # (rows, vocab part of rank 0)
    vocab_size = head.own.out_features + head.rest.out_features
    for rank in range(1, group.world_size):
        part = vocab_range(vocab_size, group.world_size, rank)
        buffer = torch.empty((hidden_rows.shape[0], len(part)), dtype=parts[0].dtype, device=comm_device)
        group.recv(buffer, rank, _LOGITS_TAG)
        parts.append(buffer.to(parts[0].device))
    return torch.cat(parts, dim=1)


def send_split_logits(model: nn.Module, hidden_rows: torch.Tensor, group: TensorParallelGroup,
                      comm_device: torch.device) -> None:
    """A follower's half: its part's logits of ``hidden_rows`` (rows, hidden), to rank 0."""
    logits = model.lm_head_packed(hidden_rows)  # (rows, this rank's vocab part); rank 0 caps the whole (cap_logits)
    group.send(logits.to(comm_device).contiguous(), 0, _LOGITS_TAG)


def linear_over(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` over ``weight`` (out, in) itself, for ``PackedLinear`` (which does not copy one matrix)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear
