"""Incremental detokenization and stop-string matching for one request."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, a few tokens at a time.

    Decoding each token alone breaks multi-byte characters and word-boundary
    spaces; decoding everything every step is quadratic. So each step decodes a
    short window that starts a few tokens back, and emits what the new token
    added, holding text back while it ends in an incomplete character.
    ``skip_special_tokens`` (the request's ``SamplingParams.skip_special_tokens``) leaves the tokenizer's special
    tokens out of the text, or writes them.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, output_token_ids: list[int]) -> str:
        """Text added by the tokens appended since the last call (may be empty)."""
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = decode(output_token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = decode(output_token_ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new_text = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(output_token_ids)
        self.text += new_text
        return new_text


def find_stop(text: str, num_new_chars: int, stops: tuple[str, ...]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, looking only where new text could complete one."""
    best: int | None = None
    for stop in stops:
        index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best
