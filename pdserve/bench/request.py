"""One benchmark request: what the workloads and dataset files produce and the backends send."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    """One prompt (token ids or text, exactly one) and how many tokens to ask for."""

    prompt_token_ids: tuple[int, ...] | None
    prompt: str | None
    output_len: int

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("a request needs exactly one of prompt_token_ids and prompt")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens, or None for a text prompt (only the server's tokenizer knows)."""
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else None
