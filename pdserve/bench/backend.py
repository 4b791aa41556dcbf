"""What the benchmark needs from a server, whatever its protocol (gRPC now, OpenAI HTTP later)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class BackendRequest:
    """One generation request as the benchmark sends it."""

    request_id: str
    prompt_token_ids: tuple[int, ...] | None
    prompt: str | None
    max_tokens: int
    temperature: float
    ignore_eos: bool
    seed: int | None
    timeout_s: float


@dataclass(frozen=True)
class Usage:
    """The server's token counts for a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    # Speculative decoding on the decode worker (0 without it): verifying steps, proposed and accepted tokens.
    spec_decode_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0


@dataclass(frozen=True)
class StreamChunk:
    """One streamed response: when it arrived, how many new tokens it carried, and usage on the last."""

    timestamp: float  # the backend's clock, read as the response arrived
    num_tokens: int
    usage: Usage | None = None


@dataclass(frozen=True)
class ModelDescription:
    """What the benchmark needs to know about the served model."""

    model_id: str
    vocab_size: int
    max_context_length: int


class BackendError(Exception):
    """A request the server failed; ``code`` is its status name (gRPC ``UNAVAILABLE``, HTTP ``503``...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Backend(Protocol):
    """A server the benchmark drives.

    ``stream`` is an async generator: it yields a ``StreamChunk`` per response,
    stamped with ``clock`` (the runner's clock) as it arrives, the last one
    carrying the usage; it raises ``BackendError`` when the server fails the request.
    """

    async def model_info(self) -> ModelDescription: ...

    def stream(self, request: BackendRequest) -> AsyncIterator[StreamChunk]: ...

    async def close(self) -> None: ...
