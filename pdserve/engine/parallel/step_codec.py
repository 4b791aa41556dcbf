"""One step's model inputs as a single int64 tensor: what rank 0 broadcasts and the other ranks run.

Rank 0 broadcasts a fixed-size header (``HEADER_LEN`` int64: the command and
the sizes), then, for a step, one payload of token ids, positions, slots, the
attention batch's lengths and block tables, and the rows whose logits every
rank computes on its vocabulary part (a split LM head's step). Two tensor
broadcasts per step, no pickling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.backend import AttentionBatch

HEADER_LEN = 8


class Command:
    """What a header tells the follower ranks to do (its first entry)."""

    STEP = 1  # run the model on the payload's batch
    EXPORT = 2  # send rank 0 the KV of some blocks' heads (kv_transfer export)
    IMPORT = 3  # write a handoff's KV into blocks, each rank its own heads
    SHUTDOWN = 4


@dataclass(frozen=True)
class StepInputs:
    """The tensors every rank's forward needs, and the batch its attention metadata is built from."""

    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    batch: AttentionBatch
    # (num_sampled,) rows of the step's hidden states whose logits the ranks compute split by
    # vocabulary (engine.parallel.vocab_head); None: rank 0 computes the logits alone.
    logits_rows: torch.Tensor | None = None


def encode_step(inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) int64 CPU tensors for ``inputs``."""
    batch = inputs.batch
    if batch.groups is not None:
        raise RuntimeError("a paged KV pool (sliding-window layers) is not served under tensor parallelism")
    table_lens = [len(table) for table in batch.block_tables]
    entries = [block for table in batch.block_tables for block in table]
    lists = torch.tensor(batch.query_lens + batch.context_lens + table_lens + entries, dtype=torch.long)
    logits_rows = inputs.logits_rows.cpu() if inputs.logits_rows is not None else torch.empty(0, dtype=torch.long)
    payload = torch.cat(
        (inputs.input_ids.cpu(), inputs.positions.cpu(), batch.slot_mapping.cpu(), lists, logits_rows)
    )  # (3 * num_tokens + 3 * num_seqs + num_entries + num_logits_rows,)
    header = torch.tensor(
        [Command.STEP, inputs.input_ids.numel(), len(batch.query_lens), batch.num_decodes, len(entries),
         payload.numel(), logits_rows.numel(), 0],
        dtype=torch.long,
    )
    return header, payload


def decode_step(
    header: torch.Tensor, payload: torch.Tensor, block_size: int, num_heads: int, num_kv_heads: int,
    device: torch.device,
) -> StepInputs:
    """The inverse of ``encode_step``, with this rank's head counts and device."""
    _, num_tokens, num_seqs, num_decodes, _, _, num_logits_rows, _ = header.tolist()
    values = payload.to(device)
    input_ids, positions, slots = values[:num_tokens], values[num_tokens : 2 * num_tokens], values[2 * num_tokens : 3 * num_tokens]
    end = payload.numel() - num_logits_rows
    logits_rows = values[end:] if num_logits_rows else None
    lists = payload[3 * num_tokens : end].tolist()
    query_lens, context_lens = lists[:num_seqs], lists[num_seqs : 2 * num_seqs]
    table_lens = lists[2 * num_seqs : 3 * num_seqs]
    tables, offset = [], 3 * num_seqs
    for n in table_lens:
        tables.append(lists[offset : offset + n])
        offset += n
    batch = AttentionBatch(
        num_decodes=num_decodes,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        slot_mapping=slots,
        block_size=block_size,
        device=device,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    return StepInputs(input_ids, positions, batch, logits_rows)
