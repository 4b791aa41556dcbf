"""Per-request sampling parameters, validated where they are built."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pdserve.engine.types.structured_outputs import StructuredOutputsParams

_GREEDY_BELOW = 1e-5
# vLLM's (and OpenAI's) ranges.
_MAX_ABS_PENALTY = 2.0
_MAX_REPETITION_PENALTY = 10.0
_MAX_ABS_LOGIT_BIAS = 100.0


class SamplingParamsError(ValueError):
    """A sampling parameter outside its domain; the message names it. ``str()`` is the message for Python callers,
    which names the type the value must have; ``typed_message`` says the same to callers whose values have their
    field's type already (a protobuf message's, at the gateway): the range alone, and which entry of a list."""

    def __init__(self, message: str, typed_message: str | None = None) -> None:
        super().__init__(message)
        self.typed_message = message if typed_message is None else typed_message


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Names and defaults follow vLLM's ``SamplingParams`` so users can move code
    between the two. ``temperature == 0`` means greedy. ``top_k == -1`` and
    ``top_p == 1`` disable those filters. ``logprobs=N`` returns, for every
    generated token, its own log-probability and the ``N`` most likely tokens
    under the raw (untempered, unfiltered) model distribution, before any of the
    logit adjustments below.

    Logit adjustments, in vLLM's order: ``min_tokens`` masks the end-of-sequence
    ids (unless ``ignore_eos``) and ``stop_token_ids`` until that many tokens
    were generated; ``logit_bias`` (token id -> bias; given as a mapping, kept
    as sorted ``(token_id, bias)`` pairs so the parameters stay immutable) is
    added; then ``repetition_penalty`` divides the positive and multiplies the
    negative logits of every token of the prompt or the output (1 disables),
    and ``frequency_penalty`` / ``presence_penalty`` subtract per occurrence /
    once for every token of the output (0 disables). Greedy rows take the argmax
    of the adjusted logits.

    ``prompt_logprobs=N`` returns the log-probability of every prompt token
    after the first, with the ``N`` most likely tokens at each position; such a
    request computes its whole prompt even when its prefix is cached.

    ``use_speculation=False`` keeps this request out of the engine's
    speculative decoding (when the engine has a ``speculative_config``): it then
    decodes one token per step. Its tokens are the same either way; only speed differs.

    ``structured_outputs`` (vLLM's name) holds the output to a JSON schema, a regex, a list of choices or a
    grammar (``engine.structured_output``): every token is sampled among those the grammar allows (the mask
    comes first: ``logprobs`` are the allowed distribution's, as vLLM's), and the request ends with "stop" when
    the grammar is complete.

    ``skip_special_tokens`` (vLLM's name and default): the output's text leaves out the tokenizer's special tokens
    (its control tokens: ``</s>``, ``<|im_end|>``, Mistral's ``[TOOL_CALLS]``, ...); ``False`` writes them, which
    a tool-call parser that looks for such a marker needs. Stop strings are matched against that text, as in
    vLLM. The token ids are the same either way.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    prompt_logprobs: int | None = None
    use_speculation: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _frozen_logit_bias(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        # Messages that name a type say it again without the type for typed callers (SamplingParamsError).
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                                      f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1 or self.top_k == 0:
            raise SamplingParamsError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}",
                                      f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise SamplingParamsError(f"seed must be a non-negative integer or None, got {self.seed!r}",
                                      f"seed must be >= 0, got {self.seed!r}")
        for index, s in enumerate(self.stop):
            if not isinstance(s, str) or s == "":
                raise SamplingParamsError(f"stop must hold non-empty strings, got {s!r}",
                                          f"stop[{index}] must not be empty" if s == "" else None)
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise SamplingParamsError(f"stop_token_ids must hold non-negative integers, got {t!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or self.logprobs < 0
        ):
            raise SamplingParamsError(f"logprobs must be a non-negative integer or None, got {self.logprobs!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            # Written so that NaN fails too.
            if not _is_number(value) or not -_MAX_ABS_PENALTY <= value <= _MAX_ABS_PENALTY:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= _MAX_REPETITION_PENALTY:
            raise SamplingParamsError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for token_id, bias in self.logit_bias:
            if not _is_int(token_id) or token_id < 0:
                raise SamplingParamsError(f"logit_bias keys must be non-negative token ids, got {token_id!r}")
            if not _is_number(bias) or not -_MAX_ABS_LOGIT_BIAS <= bias <= _MAX_ABS_LOGIT_BIAS:
                raise SamplingParamsError(f"logit_bias[{token_id}] must be in [-100, 100], got {bias!r}")
        if not isinstance(self.use_speculation, bool):
            raise SamplingParamsError(f"use_speculation must be a bool, got {self.use_speculation!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise SamplingParamsError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise SamplingParamsError(
                f"prompt_logprobs must be a non-negative integer or None, got {self.prompt_logprobs!r}"
            )
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError(
                f"structured_outputs must be a StructuredOutputsParams or None, got {type(self.structured_outputs).__name__}"
            )

    @property
    def is_greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows float32 to NaN;
        # the distribution is a point mass on the argmax anyway (vLLM does the same).
        return self.temperature < _GREEDY_BELOW

    @functools.cached_property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must change this row's logits before choosing (min_tokens, bias, penalties).

        Read for every row of every step: computed once (the parameters are frozen).
        """
        return (
            self.min_tokens > 0
            or bool(self.logit_bias)
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _frozen_logit_bias(
    logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None,
) -> tuple[tuple[int, float], ...]:
    """Sorted ``(token_id, bias)`` pairs from a mapping or pairs; values are checked by ``_validate``."""
    if logit_bias is None:
        return ()
    pairs = list(logit_bias.items()) if isinstance(logit_bias, Mapping) else list(logit_bias)
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise SamplingParamsError(f"logit_bias must map token ids to biases, got entry {pair!r}")
    token_ids = [token_id for token_id, _ in pairs]
    # Sorting needs comparable keys: a wrong key type is reported by _validate instead.
    if not all(_is_int(token_id) for token_id in token_ids):
        return tuple(pairs)
    if len(set(token_ids)) != len(token_ids):
        raise SamplingParamsError("logit_bias holds a token id twice")
    return tuple(sorted(pairs))
