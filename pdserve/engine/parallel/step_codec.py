"""One step's model inputs as a single int64 tensor: what rank 0 broadcasts and the other ranks run.

Rank 0 broadcasts a fixed-size header (``HEADER_LEN`` int64: the command and
the sizes), then, for a step, one payload of token ids, positions, slots, the
attention batch's lengths and block tables, each layer group's slots and
tables where the pool is paged (``engine.kv.pages``: rank 0 translates logical
blocks to pages, so the other ranks need no page table to run a step), and the
rows whose logits every rank computes on its vocabulary part (a split LM
head's step). Two tensor broadcasts per step, no pickling.
"""

from __future__ import annotations

import dataclasses
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
    table_lens = [len(table) for table in batch.block_tables]
    entries = [block for table in batch.block_tables for block in table]
    lists = torch.tensor(batch.query_lens + batch.context_lens + table_lens + entries, dtype=torch.long)
    # Each layer group's slots and block tables in its pages (the tables' lengths are the logical ones').
    groups = batch.groups or ()
    by_group = [
        part
        for group in groups
        for part in (group.slot_mapping.cpu(),
                     torch.tensor([block for table in group.block_tables for block in table], dtype=torch.long))
    ]
    logits_rows = inputs.logits_rows.cpu() if inputs.logits_rows is not None else torch.empty(0, dtype=torch.long)
    payload = torch.cat(
        (inputs.input_ids.cpu(), inputs.positions.cpu(), batch.slot_mapping.cpu(), lists, *by_group, logits_rows)
    )  # (3 * num_tokens + 3 * num_seqs + num_entries + num_groups * (num_tokens + num_entries) + num_logits_rows,)
    header = torch.tensor(
        [Command.STEP, inputs.input_ids.numel(), len(batch.query_lens), batch.num_decodes, len(entries),
         payload.numel(), logits_rows.numel(), len(groups)],
        dtype=torch.long,
    )
    return header, payload


def decode_step(
    header: torch.Tensor, payload: torch.Tensor, block_size: int, num_heads: int, num_kv_heads: int,
    device: torch.device, layer_groups: tuple[int, ...] = (),
) -> StepInputs:
    """The inverse of ``encode_step``, with this rank's head counts and device; ``layer_groups``: each layer's
    group, where this rank's pool is paged (the step then carries every group's slots and tables)."""
    _, num_tokens, num_seqs, num_decodes, num_entries, _, num_logits_rows, num_groups = header.tolist()
    if num_groups != (max(layer_groups) + 1 if layer_groups else 0):
        raise RuntimeError(f"a step for {num_groups} KV page groups reached a rank whose pool has "
                           f"{max(layer_groups) + 1 if layer_groups else 0}")
    values = payload.to(device)
    input_ids, positions, slots = values[:num_tokens], values[num_tokens : 2 * num_tokens], values[2 * num_tokens : 3 * num_tokens]
    end = payload.numel() - num_logits_rows
    logits_rows = values[end:] if num_logits_rows else None
    lists = payload[3 * num_tokens : end].tolist()
    query_lens, context_lens = lists[:num_seqs], lists[num_seqs : 2 * num_seqs]
    table_lens = lists[2 * num_seqs : 3 * num_seqs]

    def split(entries: list[int]) -> list[list[int]]:
        tables, offset = [], 0
        for n in table_lens:
            tables.append(entries[offset : offset + n])
            offset += n
        return tables

    tables = split(lists[3 * num_seqs : 3 * num_seqs + num_entries])
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
    if num_groups:
        groups, offset = [], 3 * num_seqs + num_entries  # in ``lists``: past the logical tables
        for _ in range(num_groups):
            start = 3 * num_tokens + offset  # the group's slots, in the payload
            group_entries = lists[offset + num_tokens : offset + num_tokens + num_entries]
            groups.append(dataclasses.replace(
                batch, block_tables=split(group_entries), slot_mapping=values[start : start + num_tokens]
            ))
            offset += num_tokens + num_entries
        batch = dataclasses.replace(batch, groups=tuple(groups), layer_groups=layer_groups)
    return StepInputs(input_ids, positions, batch, logits_rows)
