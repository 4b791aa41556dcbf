"""Turns a scheduling decision into tensors, runs the model, and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend, AttentionBatch
from engine.kv_cache import KVCache
from engine.models.llama import LlamaForCausalLM
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence


@dataclass(frozen=True)
class StepResult:
    """The sequences that got a new token this step, in the order of ``sampled.token_ids``."""

    sampled_seqs: tuple[Sequence, ...]
    sampled: SamplerOutput | None


class ModelRunner:
    """Owns the model, the KV pool and the attention backend of one engine."""

    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend, sampler: Sampler, device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_layers = kv_cache.layers()
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.block_size

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        # Decodes first: the attention backend batches them in one call.
        items = sorted(output.scheduled, key=lambda item: not item.is_decode)
        input_ids, positions, batch, sample_rows = self._prepare(items)
        metadata = self.backend.build_metadata(batch)
        hidden = self.model(input_ids, positions, self.kv_layers, self.backend, metadata)
        sampled_seqs = tuple(item.seq for item in items if item.samples)
        if not sampled_seqs:
            return StepResult((), None)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # (num_sampled, vocab)
        sampled = self.sampler(
            logits, [seq.params for seq in sampled_seqs], [seq.generator for seq in sampled_seqs]
        )
        return StepResult(sampled_seqs, sampled)

    def _prepare(
        self, items: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[int]]:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        num_decodes = 0
        for item in items:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            end = start + n
            token_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            block_tables.append(table)
            num_decodes += item.is_decode
            if item.samples:
                sample_rows.append(len(token_ids) - 1)
        device = self.device
        batch = AttentionBatch(
            num_decodes=num_decodes,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_size=bs,
            device=device,
        )
        return (
            torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            batch,
            sample_rows,
        )
