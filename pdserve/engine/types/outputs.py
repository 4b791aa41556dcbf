"""What the engine hands back to its callers: a request's outputs, and the load snapshot of an engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.types.handoff import KVHandoff


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities around one generated (or prompt) token, under the raw model distribution."""

    token_id: int
    logprob: float
    # The N most likely tokens at that position, most likely first.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SpecDecodeStats:
    """What speculative decoding did for one request so far.

    ``num_drafts``: steps that verified a proposal; ``num_draft_tokens``:
    proposed tokens verified; ``num_accepted_tokens``: those the target kept.
    """

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Share of the verified proposed tokens that were kept (0 when none were verified)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step produced on average: the accepted ones plus the target's own (vLLM's
        "mean acceptance length"); 1 when no step verified."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class RequestOutput:
    """The state of one request: its tokens so far, and why it finished if it has.

    ``token_ids`` and ``text`` are cumulative. ``num_cached_tokens`` counts the
    prompt tokens served from the prefix cache when the request was admitted.
    ``prompt_logprobs`` (when the request set ``prompt_logprobs``): one entry per
    prompt token from the second on, ``token_id`` being the prompt token; there
    from the request's first output on, computed once (a preempted request does
    not compute them again). None on an engine that continues a request
    prefilled elsewhere: they were delivered there.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # On the last output of a request added with hold_kv: its held KV, as a decode worker takes it over.
    kv_handoff: KVHandoff | None = None
    # None when the engine does not speculate.
    spec_decode_stats: SpecDecodeStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A load snapshot, for routing and metrics."""

    num_running: int
    num_waiting: int
    num_queued_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    num_held: int  # finished requests whose blocks are pinned for export (leases)
    num_preemptions: int
    # KV pushed here whose request has not claimed it yet (pushes), and its size.
    num_pushed: int = 0
    num_pushed_bytes: int = 0
    # What handoffs held that nobody claimed before the handoff deadline: leases here, pushes here.
    num_expired_leases: int = 0
    num_expired_pushes: int = 0
    # Speculative decoding since start (0 without it): verifying steps, proposed and accepted tokens.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # LoRA adapters held (in slots first, then in host memory only).
    lora_adapters: tuple[str, ...] = ()
