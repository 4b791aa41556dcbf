"""``speculative_config``: which proposer, how many tokens, when to step aside (vLLM's names)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")
# Weight formats a draft may be loaded in (pdserve/engine/layers/linear.py); None: the checkpoint's floats.
DRAFT_QUANTIZATIONS = (None, "int8", "int4")
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Above this many requests in the engine (running + waiting) nobody speculates:
# the step is no longer memory-bound and verifying rejected tokens costs more
# than it saves. Measured per method by the batch sweep of benchmarks/spec_decode.py
# (BENCHMARKS.md, `spec_decode`): n-gram still paid at 4 and lost at 8; the
# draft model, whose own forwards grow with the batch, paid at 2 and lost at 4.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 4, "draft_model": 2}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates; build it with ``from_dict`` (what ``LLM(speculative_config=...)`` and
    ``--speculative-config`` take).

    ``ngram``: prompt lookup: the longest suffix of the request's tokens, from
    ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens long, is looked up
    at its latest earlier occurrence in the prompt and output, and the tokens
    that followed it are proposed. ``draft_model``: ``model`` (a Llama or Qwen2
    checkpoint with the target's vocabulary), loaded in ``dtype`` with weight
    ``quantization``, proposes greedily. Either way at most
    ``num_speculative_tokens`` tokens are proposed per request and step, and
    nobody speculates while more than ``disable_by_batch_size`` requests are in
    the engine (default: the method's measured cut-off). With ``adaptive`` each
    request proposes fewer tokens, or none for a while, where its recent
    acceptance does not pay for the measured cost of proposing and verifying them.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    quantization: str | None = None
    quantization_group_size: int = 32
    dtype: str = "auto"
    # None: the method's measured default (DEFAULT_DISABLE_BY_BATCH_SIZE).
    disable_by_batch_size: int | None = None
    # True: each request proposes as many tokens (0..num_speculative_tokens) as its
    # recent acceptance and the measured step costs say pay (pdserve/engine/spec_decode/adaptive.py).
    # False (vLLM's behaviour): always num_speculative_tokens where allowed.
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.disable_by_batch_size is None:
            object.__setattr__(self, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE[self.method])
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be a bool, got {self.adaptive!r}")
        if self.method == "ngram":
            _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                    f"prompt_lookup_max ({self.prompt_lookup_max})"
                )
            for name in ("model", "quantization"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'draft_model', not 'ngram'")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model (the draft checkpoint) is required for method 'draft_model'")
            if self.quantization not in DRAFT_QUANTIZATIONS:
                raise ValueError(
                    f"speculative_config.quantization must be one of {DRAFT_QUANTIZATIONS}, got {self.quantization!r}"
                )
            if self.dtype not in DRAFT_DTYPES:
                raise ValueError(f"speculative_config.dtype must be one of {DRAFT_DTYPES}, got {self.dtype!r}")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | str) -> SpeculativeConfig:
        """From vLLM's dict shape (or its JSON text); an unknown key is an error naming it."""
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from error
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a mapping, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in config:
                raise ValueError(f"speculative_config.{required} is required")
        return cls(**dict(config))

    def to_json(self) -> str:
        """The fields that differ from the defaults, as ``from_dict`` reads them back."""
        defaults = {f.name: f.default for f in fields(self)}
        defaults["disable_by_batch_size"] = DEFAULT_DISABLE_BY_BATCH_SIZE[self.method]
        return json.dumps({name: getattr(self, name) for name in defaults if getattr(self, name) != defaults[name]})


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"speculative_config.{name} must be an integer >= {minimum}, got {value!r}")
