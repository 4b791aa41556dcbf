"""What one benchmark request did: the per-request record every metric is computed from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestError:
    """Why a request failed: a gRPC status name (``UNAVAILABLE``...) or a client-side code, and its message."""

    code: str
    message: str


@dataclass(frozen=True)
class RequestRecord:
    """One request's timeline, in seconds on the run's clock (0 is the moment the run started).

    ``chunk_times`` holds the arrival of every streamed response that carried
    at least one new token, ``chunk_tokens`` how many it carried. Token counts
    come from the server's final usage; a failed request has no usage, so its
    counts are 0 and it is left out of every latency and throughput figure.
    """

    index: int
    start: float  # when the request was sent (after any wait for a concurrency slot)
    end: float  # when its stream closed, or failed
    chunk_times: tuple[float, ...]
    chunk_tokens: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int
    error: RequestError | None = None
    # Speculative decoding, from the final usage (0 without it).
    spec_decode_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if len(self.chunk_times) != len(self.chunk_tokens):
            raise ValueError(
                f"request {self.index}: {len(self.chunk_times)} chunk times for {len(self.chunk_tokens)} chunks"
            )
        if self.error is None and not self.chunk_times:
            # Every latency figure starts at the first token; a success without one is a runner bug.
            raise ValueError(f"request {self.index} succeeded without a single token")

    @property
    def ok(self) -> bool:
        return self.error is None
