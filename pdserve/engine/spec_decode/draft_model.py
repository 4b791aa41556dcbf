"""The draft-model proposer: a smaller (or lower-precision) checkpoint guesses greedily.

Its KV lives in a pool parallel to the target's: block ``b`` of the draft pool
holds the draft's K/V for the same token slots as block ``b`` of the target's,
so the target's block manager is the only accounting (a block allocated, shared
through the prefix cache, or freed is so for both pools) and nothing about the
draft crosses the scheduler. The draft's content is filled lazily: each
sequence records how far its draft KV reaches (``Sequence.num_draft_computed_tokens``,
reset whenever its blocks are freed) and the draft catches up on the tokens
since, in the same forward that proposes the first token. Draft KV only affects
which tokens are proposed, never which are kept, so a block shared through the
prefix cache may be rewritten by another sequence's catch-up with the same
values without harm, and steps that do not speculate cost the draft nothing.
A prefill engine with ``handoff_draft_kv`` runs ``fill`` over each held
request's prompt instead, and the handoff carries that KV (its draft section):
a decode engine whose draft ``accepts`` it imports it and starts its draft KV
at the end of the prompt.

Positions past the target's blocks (the proposal's own tokens, and the last
token when it opens a new block) are written to scratch blocks that only the
draft pool has, ``blocks_per_seq`` per sequence of the proposing batch; the next
step verifies those tokens and the draft recomputes the accepted ones. Proposed
tokens whose KV landed in the sequence's own blocks are remembered
(``DraftProposal``): the ones the target kept need no recomputing, so in a steady
run the catch-up is the target's own token after them (one row, a fused decode
step) rather than the whole accepted run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pdserve.engine.attention.backend import AttentionBatch
from pdserve.engine.attention.selector import select_backend
from pdserve.engine.kv.cache import KVCache, bytes_per_block
from pdserve.engine.kv.handoff import dtype_name
from pdserve.engine.model_loader import TORCH_DTYPES, load_hf_config, load_model, resolve_model_path
from pdserve.engine.sampler import first_argmax
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.proposer import Proposer
from pdserve.engine.types.handoff import KVLayout
from pdserve.engine.types.speculative import SpeculativeConfig


@dataclass(frozen=True)
class DraftProposal:
    """Proposed tokens whose draft KV was written at positions ``start`` on, inside ``blocks`` (the
    sequence's own, as its table began then): valid for as many of them as the sequence kept."""

    start: int
    token_ids: tuple[int, ...]
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class DraftTarget:
    """What the draft must agree with: the target engine's vocabulary, KV pool geometry and device."""

    model_id: str
    vocab_size: int
    block_size: int
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    attention_backend: str
    max_num_seqs: int
    # The target's enforce_eager: the draft runs its decode steps layer by layer too.
    enforce_eager: bool = False


class DraftModelProposer(Proposer):
    """Greedy proposals from a draft model over its own paged KV (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, target: DraftTarget) -> None:
        assert config.model is not None
        path = resolve_model_path(config.model)
        hf_config = load_hf_config(path)
        draft_vocab = int(hf_config.vocab_size)
        if draft_vocab != target.vocab_size:
            raise ValueError(
                f"speculative_config.model {config.model!r} has a vocabulary of {draft_vocab} tokens, "
                f"the target model {target.model_id!r} {target.vocab_size}: a draft must share the target's tokenizer"
            )
        max_positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        if max_positions and max_positions < target.max_model_len:
            raise ValueError(
                f"speculative_config.model {config.model!r} handles {max_positions} positions, fewer than the "
                f"target's max_model_len ({target.max_model_len})"
            )
        self.dtype = target.dtype if config.dtype == "auto" else TORCH_DTYPES[config.dtype]
        self.device = target.device
        self.model = load_model(
            path, hf_config, target.max_model_len, self.dtype, self.device,
            config.quantization, config.quantization_group_size, enforce_eager=target.enforce_eager,
        )
        self.block_size = bs = target.block_size
        self.num_layers = int(hf_config.num_hidden_layers)
        # Scratch for positions N-1 .. N+k-2 beyond the target's blocks (the last
        # token may open a new block, the proposal runs k-1 positions further).
        self.blocks_per_seq = -(-config.num_speculative_tokens // bs) + 1
        self.max_seqs = min(config.disable_by_batch_size, target.max_num_seqs)
        self.block_bytes = bytes_per_block(
            self.num_layers, bs, self.model.num_kv_heads, self.model.head_dim, self.dtype, self.model.kv_parts
        )
        self.backend = select_backend(target.attention_backend, self.device, self.dtype, self.dtype)
        self.num_target_blocks = 0
        self.kv_cache: KVCache | None = None
        # Which draft this is, as a handoff's draft section names the draft that built it:
        # KV from another checkpoint, dtype or weight format would propose differently.
        self.identity = json.dumps(
            [config.model, str(self.dtype).removeprefix("torch."), config.quantization, config.quantization_group_size]
        )
        self.kv_layout = KVLayout(
            num_layers=self.num_layers, num_kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim,
            block_size=bs, dtype=dtype_name(self.dtype), kv_parts=self.model.kv_parts,
        )

    def allocate_kv(self, num_target_blocks: int) -> None:
        """The draft's pool: one block per target block (same ids), then the scratch blocks."""
        self.num_target_blocks = num_target_blocks
        self.kv_cache = KVCache(
            self.num_layers, num_target_blocks + self.max_seqs * self.blocks_per_seq, self.block_size,
            self.model.num_kv_heads, self.model.head_dim, self.dtype, self.device, self.model.kv_parts,
        )
        self.kv_layers = self.kv_cache.layers()

    @torch.inference_mode()
    def fill(self, seqs: Seq[Sequence]) -> None:
        """Build the draft's KV for every token each sequence has computed (a prefill engine: its prompt),
        in the sequence's own blocks: what a handoff's draft section carries."""
        todo = [seq for seq in seqs if seq.num_draft_computed_tokens < seq.num_computed_tokens]
        if not todo:
            return
        self._forward(
            [seq.token_ids[seq.num_draft_computed_tokens : seq.num_computed_tokens] for seq in todo],
            [seq.num_draft_computed_tokens for seq in todo],
            [seq.block_table for seq in todo],
        )
        for seq in todo:
            seq.num_draft_computed_tokens = seq.num_computed_tokens

    def accepts(self, layout: KVLayout, draft_model_id: str) -> bool:
        """Whether a handoff's draft section was built by this draft and fits its pool (dtype converts on import)."""
        return draft_model_id == self.identity and (
            layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
        ) == (self.num_layers, self.model.num_kv_heads, self.model.head_dim, self.block_size)

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[list[int]]:
        if len(seqs) > self.max_seqs:
            raise RuntimeError(f"{len(seqs)} sequences propose at once, the draft's scratch holds {self.max_seqs}")
        tables = [self._table(i, seq) for i, seq in enumerate(seqs)]
        for seq in seqs:
            self._adopt_kept_proposal(seq)
        # First forward: each sequence's tokens since its draft KV ends, up to its last token.
        starts = [seq.num_draft_computed_tokens for seq in seqs]
        chunks = [seq.token_ids[start:] for seq, start in zip(seqs, starts)]
        next_ids = self._forward(chunks, starts, tables)
        proposals = [[token] for token in next_ids]
        for seq in seqs:
            # Only the KV inside the target's blocks survives this call.
            seq.num_draft_computed_tokens = min(seq.num_tokens, len(seq.block_table) * self.block_size)
        # Then one token at a time, for the sequences that want more.
        for step in range(1, max(max_tokens)):
            live = [i for i, k in enumerate(max_tokens) if k > step]
            next_ids = self._forward(
                [[proposals[i][-1]] for i in live],
                [seqs[i].num_tokens + step - 1 for i in live],
                [tables[i] for i in live],
            )
            for i, token in zip(live, next_ids):
                proposals[i].append(token)
        for seq, proposal in zip(seqs, proposals):
            self._remember_proposal(seq, proposal)
        return proposals

    def _remember_proposal(self, seq: Sequence, proposal: list[int]) -> None:
        """Which of ``proposal``'s tokens have their draft KV in ``seq``'s own blocks: all but the last
        were fed back, at positions ``num_tokens`` on; those past its table went to scratch."""
        start = seq.num_tokens
        seq.draft_proposal = None
        if seq.num_draft_computed_tokens != start:
            return  # its last token's KV is in scratch, and so is all that follows
        in_own_blocks = min(len(proposal) - 1, len(seq.block_table) * self.block_size - start)
        if in_own_blocks > 0:
            last_block = (start + in_own_blocks - 1) // self.block_size
            seq.draft_proposal = DraftProposal(start, tuple(proposal[:in_own_blocks]),
                                               tuple(seq.block_table[: last_block + 1]))

    @staticmethod
    def _adopt_kept_proposal(seq: Sequence) -> None:
        """Count the draft KV of the proposed tokens the target kept as computed (see ``DraftProposal``)."""
        proposal, seq.draft_proposal = seq.draft_proposal, None
        if not isinstance(proposal, DraftProposal) or seq.num_draft_computed_tokens != proposal.start:
            return
        if tuple(seq.block_table[: len(proposal.blocks)]) != proposal.blocks:
            return  # freed and allocated again since: that KV is gone
        kept = 0
        # Never the last token: the first forward needs it, to propose after it.
        for token, proposed in zip(seq.token_ids[proposal.start : seq.num_tokens - 1], proposal.token_ids):
            if token != proposed:
                break
            kept += 1
        seq.num_draft_computed_tokens += kept

    def catches_up(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> bool:
        # A steady step catches up on at most the last run: the accepted tokens and the one after them.
        return any(seq.num_tokens - seq.num_draft_computed_tokens > k + 1 for seq, k in zip(seqs, max_tokens))

    def _table(self, index: int, seq: Sequence) -> list[int]:
        """The sequence's blocks, then its scratch blocks: enough for every position this call writes."""
        first = self.num_target_blocks + index * self.blocks_per_seq
        return seq.block_table + list(range(first, first + self.blocks_per_seq))

    def _forward(self, chunks: list[list[int]], starts: list[int], tables: list[list[int]]) -> list[int]:
        """Run the draft on each chunk (written at positions from ``starts``); the greedy next token of each."""
        bs = self.block_size
        # Single-token chunks over a cached context first: attention batches them as decodes.
        order = sorted(range(len(chunks)), key=lambda i: not (len(chunks[i]) == 1 and starts[i] > 0))
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        for i in order:
            start, table = starts[i], tables[i]
            end = start + len(chunks[i])
            token_ids.extend(chunks[i])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            last_rows.append(len(token_ids) - 1)
        device = self.device
        batch = AttentionBatch(
            num_decodes=sum(1 for i in order if len(chunks[i]) == 1 and starts[i] > 0),
            query_lens=[len(chunks[i]) for i in order],
            context_lens=[starts[i] + len(chunks[i]) for i in order],
            block_tables=[tables[i] for i in order],
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_size=bs,
            device=device,
            num_heads=self.model.config.num_attention_heads,
            num_kv_heads=self.model.num_kv_heads,
        )
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            self.kv_layers,
            self.backend,
            self.backend.build_metadata(batch),
        )
        rows = torch.tensor(last_rows, dtype=torch.long, device=device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # (len(chunks), vocab)
        # A greedy guess needs no softmax. Widened first: argmax over bf16 is ~8x slower than over float32
        # on CPU (0.9 against 0.1 ms over 49,152 logits, about 2% of a draft forward), and widening is exact.
        greedy = first_argmax(logits.float().contiguous()).tolist()
        by_input = [0] * len(chunks)
        for i, token in zip(order, greedy):
            by_input[i] = token
        return by_input
