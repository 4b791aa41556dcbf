"""Turns a scheduling decision into tensors, runs the model, and samples."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.attention.backend import AttentionBackend, AttentionBatch, LayerMetadata
from pdserve.engine.grammar_masks import GrammarMasks
from pdserve.engine.kv.cache import KVCache
from pdserve.engine.logits_processors import TokenHistory
from pdserve.engine.lora import LoRAManager
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.parallel.ranks import LeaderRanks
from pdserve.engine.parallel.step_codec import StepInputs
from pdserve.engine.parallel.vocab_head import uses_split_head
from pdserve.engine.sampler import Sampler, SamplerOutput
from pdserve.engine.scheduler import ScheduledSequence, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.types.outputs import TokenLogprobs

# Prompt logprobs need the logits of every prompt position: computed this many
# positions at a time, so a 2048-token chunk never holds (2048, vocab) at once.
PROMPT_LOGITS_ROWS = 256


@dataclass(frozen=True)
class StepResult:
    """The sequences that got a new token this step, in the order of ``sampled.token_ids``.

    ``prompt_logprobs``: for each sequence that asked, the entries of the prompt
    positions this step computed for the first time, in prompt order.
    """

    sampled_seqs: tuple[Sequence, ...]
    sampled: SamplerOutput | None
    prompt_logprobs: tuple[tuple[Sequence, list[TokenLogprobs]], ...] = ()
    # Per sampled sequence, the proposal it verified: its rows in ``sampled`` are
    # 1 + len(proposal) consecutive ones, position by position.
    spec_token_ids: tuple[tuple[int, ...], ...] = ()


class ModelRunner:
    """Owns the model, the KV pool and the attention backend of one engine."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        backend: AttentionBackend,
        sampler: Sampler | None,
        device: torch.device,
        parallel: LeaderRanks | None = None,
    ) -> None:
        """``parallel``: with tensor parallelism, rank 0's handle on the other ranks, which get each
        step's inputs and run ``forward`` on their shards with this rank; ``sampler``: rank 0's only."""
        self.model = model
        self.kv_cache = kv_cache
        self.kv_layers = kv_cache.layers()
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.block_size
        self.parallel = parallel
        layout = kv_cache.layout
        # Each layer's page group, where the pool is paged (engine.kv.pages); () otherwise.
        self.layer_groups = () if layout is None else tuple(layout.place(i)[0] for i in range(layout.num_layers))
        # LoRA adapters (set by the engine when it serves them): each step tells them each token's slot.
        self.lora: LoRAManager | None = None
        # Structured output's token masks (made on the first constrained step): filled beside the forward on an
        # accelerator, before it on CPU.
        self._grammar_masks: GrammarMasks | None = None

    def shutdown(self) -> None:
        if self._grammar_masks is not None:
            self._grammar_masks.shutdown()

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        # Decodes first: the attention backend batches them in one call.
        items = sorted(output.scheduled, key=lambda item: not item.is_decode)
        input_ids, positions, batch, sample_rows = self._prepare(items)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        masks = self._start_masks(items)
        if self.lora is not None:
            slots = [-1 if item.seq.lora_slot is None else item.seq.lora_slot for item in items]
            self.lora.set_rows(slots, [item.num_new_tokens for item in items], self.device)
        logits = None  # (num_sampled_rows, vocab)
        if self.parallel is None:
            hidden = self.forward(StepInputs(input_ids, positions, batch))
        else:
            # Few sampled rows: every rank computes its vocabulary part of their logits.
            split = uses_split_head(len(sample_rows))
            inputs = StepInputs(input_ids, positions, batch, rows if split else None)
            # The whole step under the group's lock: its collectives must not interleave with
            # a KV export's (issued from a transfer thread).
            with self.parallel.lock:
                self.parallel.broadcast_step(inputs)
                hidden = self.forward(inputs)
                if split:
                    logits = self.parallel.gather_logits(self.model, hidden.index_select(0, rows))
        prompt_logprobs = self._prompt_logprobs(items, hidden)
        sampling = [item for item in items if item.samples]
        if not sampling:
            return StepResult((), None, prompt_logprobs)
        if logits is None:
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        if masks is not None:
            assert self._grammar_masks is not None
            self._grammar_masks.apply(logits, masks)
        # A sequence verifying a proposal has one row per position: each samples
        # exactly as plain decoding would once the proposed tokens before it are in.
        row_items = [item for item in sampling for _ in range(item.num_sampled_rows)]
        params = [item.seq.params for item in row_items]
        histories = None
        if any(p.adjusts_logits for p in params):
            histories = [
                _history(item.seq, item.spec_token_ids[:j]) if item.seq.params.adjusts_logits else None
                for item in sampling
                for j in range(item.num_sampled_rows)
            ]
        assert self.sampler is not None
        sampled = self.sampler(logits, params, [item.seq.generator for item in row_items], histories)
        return StepResult(
            tuple(item.seq for item in sampling), sampled, prompt_logprobs, tuple(i.spec_token_ids for i in sampling)
        )

    def _start_masks(self, items: list[ScheduledSequence]) -> Future[tuple[list[int], torch.Tensor]] | None:
        """Start filling the token masks of the step's constrained sampled rows (None: no such row)."""
        matchers = []
        row = 0
        for item in items:
            if not item.samples:
                continue
            grammar = item.seq.grammar
            if grammar is not None:
                matcher = grammar.matcher(item.seq.output_token_ids)
                # None: the grammar is not active yet (the thinking before it), or it failed and the request ends
                # when its token comes back (grammar.error).
                if matcher is not None:
                    # A verifying sequence's rows: the mask after each proposed token in turn.
                    matchers.append((row, matcher, item.spec_token_ids))
            row += item.num_sampled_rows
        if not matchers:
            return None
        if self._grammar_masks is None:
            # Overlapped with the forward where it runs on an accelerator; on CPU its OpenMP team has the cores.
            self._grammar_masks = GrammarMasks(int(self.model.config.vocab_size), overlap=self.device.type != "cpu")
        return self._grammar_masks.start(matchers)

    def forward(self, inputs: StepInputs) -> torch.Tensor:  # (num_tokens, hidden)
        """The model over one step's tokens on this rank's shard (every rank runs this)."""
        batch = inputs.batch
        if batch.groups is None:
            metadata = self.backend.build_metadata(batch)
        else:
            by_group = [self.backend.build_metadata(group) for group in batch.groups]
            metadata = LayerMetadata(by_group[group] for group in batch.layer_groups)
        return self.model(inputs.input_ids, inputs.positions, self.kv_layers, self.backend, metadata)

    def _prompt_logprobs(
        self, items: list[ScheduledSequence], hidden: torch.Tensor
    ) -> tuple[tuple[Sequence, list[TokenLogprobs]], ...]:
        """Log-probabilities of the prompt tokens whose context this step computed, for the sequences that ask.

        Position ``p``'s logits give the distribution of token ``p + 1``; the last
        prompt position's is the first output token's, which is sampled instead.
        Positions reported before a preemption are not reported again.
        """
        results = []
        offset = 0  # row of the item's first token in ``hidden``
        for item in items:
            seq, item_offset = item.seq, offset
            offset += item.num_new_tokens
            if not seq.needs_prompt_logprobs:
                continue
            assert seq.prompt_logprobs is not None
            num_done = len(seq.prompt_logprobs)
            # A sequence that needs them is never admitted on a prefix hit, so its
            # chunks start at or before the first position still to report.
            assert item.start <= num_done, (item.start, num_done)
            last = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if num_done < last:
                row_of_position_zero = item_offset - item.start
                results.append((seq, self._positions_logprobs(hidden, seq, row_of_position_zero, num_done, last)))
        return tuple(results)

    def _positions_logprobs(
        self, hidden: torch.Tensor, seq: Sequence, row_of_position_zero: int, first: int, last: int
    ) -> list[TokenLogprobs]:
        """Entries for positions [first, last) of ``seq``: the next prompt token's logprob and the top N."""
        num_top = seq.params.prompt_logprobs or 0
        entries: list[TokenLogprobs] = []
        for start in range(first, last, PROMPT_LOGITS_ROWS):
            end = min(start + PROMPT_LOGITS_ROWS, last)
            rows = hidden[row_of_position_zero + start : row_of_position_zero + end]  # (m, hidden)
            logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)  # (m, vocab)
            targets = seq.token_ids[start + 1 : end + 1]
            target_index = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
            own = logprobs.gather(1, target_index).squeeze(1).tolist()
            if num_top:
                top_lps, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1, sorted=True)
                tops = [tuple(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lps.tolist())]
            else:
                tops = [()] * len(targets)
            entries.extend(TokenLogprobs(t, lp, top) for t, lp, top in zip(targets, own, tops))
        return entries

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
            num_real = n - len(item.spec_token_ids)
            token_ids.extend(seq.token_ids[start : start + num_real])
            token_ids.extend(item.spec_token_ids)
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            block_tables.append(table)
            num_decodes += item.is_decode
            if item.samples:
                sample_rows.extend(range(len(token_ids) - item.num_sampled_rows, len(token_ids)))
        device = self.device
        batch = AttentionBatch(
            num_decodes=num_decodes,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_size=bs,
            device=device,
            num_heads=self.model.num_heads,
            num_kv_heads=self.model.num_kv_heads,
        )
        if self.kv_cache.layout is not None:
            batch = self._group_batches(batch, slots)
        return (
            torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            batch,
            sample_rows,
        )


    def _group_batches(self, batch: AttentionBatch, slots: list[int]) -> AttentionBatch:
        """``batch`` with each layer group's own: block tables and slots in that group's pages (a page a window
        freed reads as page 0, which the window masks)."""
        pages = self.kv_cache.page_map.pages  # type: ignore[union-attr]
        bs = self.block_size
        logical = np.asarray(slots, dtype=np.int64)
        slot_pages = pages[logical // bs]  # (num_tokens, groups)
        tables = [pages[np.asarray(table, dtype=np.int64)].clip(min=0) for table in batch.block_tables]
        device = self.device
        groups = []
        for group in range(pages.shape[1]):
            group_slots = slot_pages[:, group] * bs + logical % bs
            groups.append(dataclasses.replace(
                batch,
                block_tables=[table[:, group].tolist() for table in tables],
                slot_mapping=torch.from_numpy(group_slots).to(device),
            ))
        return dataclasses.replace(batch, groups=tuple(groups), layer_groups=self.layer_groups)


def _history(seq: Sequence, proposed: tuple[int, ...]) -> TokenHistory:
    """The tokens a position's logit adjustments read: the sequence's, then the proposed ones before it."""
    if not proposed:
        return TokenHistory(seq.token_ids, seq.num_prompt_tokens)
    return TokenHistory(seq.token_ids + list(proposed), seq.num_prompt_tokens)
