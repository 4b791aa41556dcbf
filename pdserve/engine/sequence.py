"""One request as the scheduler sees it: its tokens, its blocks, its progress."""

from __future__ import annotations

import enum

import torch

from pdserve.engine.structured_output import RequestGrammar
from pdserve.engine.types.handoff import KVHoldParams, KVReservation
from pdserve.engine.types.hashing import BlockHash, hash_block
from pdserve.engine.types.lora import LoRARequest
from pdserve.engine.types.outputs import TokenLogprobs
from pdserve.engine.types.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    # Prefilled elsewhere: queued for blocks, then holding them until the KV lands (vLLM v1's name).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"  # holds blocks and is scheduled every step
    FINISHED = "finished"


class Sequence:
    """Token ids, KV block table and progress of one request.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache. A
    sequence is prefilling while it is below ``num_prompt_tokens`` and decoding
    afterwards; after preemption it drops to zero and the same code path
    recomputes prompt and output alike.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        model_id: str,
        generator: torch.Generator | None = None,
        block_hashes: tuple[BlockHash, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.block_size = block_size
        self.model_id = model_id
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission; kept
        # across preemption so the user sees what the first admission saved.
        self.num_cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # Grows chunk by chunk as the prompt is computed; None when not asked for
        # (or delivered by the engine that prefilled the request).
        self.prompt_logprobs: list[TokenLogprobs] | None = [] if params.prompt_logprobs is not None else None
        # Seeded from a handoff on a decode engine: the prefill engine hashed those blocks already.
        self._block_hashes: list[BlockHash] = list(block_hashes)
        # Set on a prefill engine: when the request finishes, its blocks go to the lease table.
        self.kv_hold: KVHoldParams | None = None
        # Set on a decode engine: blocks that already hold the pushed KV, adopted when the request is allocated.
        self.kv_reservation: KVReservation | None = None
        # Speculative decoding: the proposal for the next step (scheduled as extra
        # query tokens, never part of ``token_ids`` until verified), and counters.
        self.spec_token_ids: list[int] = []
        self.num_spec_steps = 0  # steps that verified a proposal
        self.num_draft_tokens = 0  # proposed tokens verified
        self.num_accepted_tokens = 0  # of those, the ones the target kept
        # Tokens whose draft-model KV is in the draft's parallel pool (same block
        # ids); reset with num_computed_tokens whenever the blocks are freed.
        self.num_draft_computed_tokens = 0
        # The draft's last proposal, whose KV it wrote in this sequence's own blocks
        # (engine.spec_decode.draft_model.DraftProposal); None when there is none.
        self.draft_proposal: object | None = None
        # Structured output: the request's grammar state (set by the engine when it registers the request).
        self.grammar: RequestGrammar | None = None
        # LoRA: the adapter the request runs under (None: the base model) and its slot while it holds one.
        self.lora_request: LoRARequest | None = None
        self.lora_slot: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt position still has to report its log-probability (no prefix-cache hit then)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def block_hashes(self) -> list[BlockHash]:
        """Hashes of every full block of the token ids so far, computed as tokens arrive."""
        bs = self.block_size
        while (len(self._block_hashes) + 1) * bs <= len(self.token_ids):
            i = len(self._block_hashes)
            parent = self._block_hashes[-1] if i else None
            self._block_hashes.append(hash_block(parent, self.token_ids[i * bs : (i + 1) * bs], self.model_id))
        return self._block_hashes

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
