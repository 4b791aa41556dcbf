"""Precision settings that accuracy and precision_speed compare: weight dtype, weight quantization, KV cache dtype.

A setting is written ``DTYPE[:QUANTIZATION[:KV_CACHE_DTYPE[:LM_HEAD[:EXECUTION]]]]`` on the command line,
an empty part or ``-`` meaning "not set" (no quantization, the KV cache in the
model's dtype, the engine's LM head default): ``float32``, ``bfloat16``, ``bfloat16:int8``,
``bfloat16:int4:int8``, ``bfloat16::int8`` (bf16 weights, int8 KV), ``bfloat16:int4::float``
(INT4 layers with the LM head left in bf16; ``int8`` asks for the quantized head, the default
under quantization), ``bfloat16:int4:::eager`` (every step layer by layer: ``enforce_eager=True``;
``fused`` asks for the fused decode step, the default; ``library`` keeps unquantized layers off pdserve's
dense kernels, on the libraries torch calls (MKL for float32, oneDNN for bf16) and, in bf16, layer by
layer: the engine without its own dense kernels, on a CPU where they serve). Parts that are not set are not passed
to ``LLM`` at all, so a setting the engine of this checkout does not know yet
fails at construction, and the benchmarks report it as unsupported instead of crashing.
"""

from __future__ import annotations

import gc
import traceback
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4")
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")
LM_HEADS = ("float", "int8")
EXECUTIONS = ("fused", "eager", "library")
REFERENCE = "float32"

T = TypeVar("T")


@dataclass(frozen=True)
class PrecisionSetting:
    """One column of the comparison; ``None`` for a part that is left at the engine's default."""

    dtype: str
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    lm_head: str | None = None
    execution: str | None = None

    @property
    def name(self) -> str:
        """The command-line spelling, with trailing unset parts dropped."""
        parts = [self.dtype, self.quantization or "", self.kv_cache_dtype or "", self.lm_head or "", self.execution or ""]
        while parts and not parts[-1]:
            parts.pop()
        return ":".join(parts)

    @property
    def base(self) -> PrecisionSetting | None:
        """The same weights with the KV cache in the model's dtype: what int8 KV is judged against."""
        if self.kv_cache_dtype in (None, "auto"):
            return None
        return PrecisionSetting(self.dtype, self.quantization, lm_head=self.lm_head, execution=self.execution)

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if self.quantization is not None:
            kwargs["quantization"] = self.quantization
        if self.kv_cache_dtype is not None:
            kwargs["kv_cache_dtype"] = self.kv_cache_dtype
        if self.lm_head is not None:
            kwargs["quantize_lm_head"] = self.lm_head == "int8"
        if self.execution in ("fused", "eager"):
            kwargs["enforce_eager"] = self.execution == "eager"
        return kwargs


def parse_setting(text: str) -> PrecisionSetting:
    """``DTYPE[:QUANTIZATION[:KV_CACHE_DTYPE[:LM_HEAD[:EXECUTION]]]]``; raises ``ValueError`` naming the bad part."""
    parts = [part.strip() for part in text.split(":")]
    if len(parts) > 5:
        raise ValueError(f"setting {text!r}: expected DTYPE[:QUANTIZATION[:KV_CACHE_DTYPE[:LM_HEAD[:EXECUTION]]]]")
    parts += [""] * (5 - len(parts))
    dtype, quantization, kv_cache_dtype, lm_head, execution = (None if part in ("", "-") else part for part in parts)
    if dtype not in DTYPES:
        raise ValueError(f"setting {text!r}: dtype must be one of {DTYPES}, got {dtype!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"setting {text!r}: quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"setting {text!r}: kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
        )
    if lm_head is not None and lm_head not in LM_HEADS:
        raise ValueError(f"setting {text!r}: lm_head must be one of {LM_HEADS}, got {lm_head!r}")
    if execution is not None and execution not in EXECUTIONS:
        raise ValueError(f"setting {text!r}: execution must be one of {EXECUTIONS}, got {execution!r}")
    return PrecisionSetting(dtype, quantization, kv_cache_dtype, lm_head, execution)


def parse_settings(texts: list[str]) -> list[PrecisionSetting]:
    """Parsed in order, duplicates dropped, float32 first: it is the reference every ratio is taken against."""
    settings = [PrecisionSetting(REFERENCE)]
    for text in texts:
        setting = parse_setting(text)
        if setting not in settings:
            settings.append(setting)
    return settings


def build_llm(setting: PrecisionSetting, **llm_kwargs: Any) -> Any:
    """An ``LLM`` in ``setting``; whatever the constructor raises (unknown keyword, refused value) propagates."""
    from pdserve.engine import LLM
    from pdserve.engine.layers import linear

    if setting.execution != "library":
        return LLM(**setting.llm_kwargs(), **llm_kwargs)
    # The weights are packed while the model loads: with the kernels switched off then, they stay off.
    kernels = linear._dense_kernels
    linear._dense_kernels = lambda dtype: None
    try:
        return LLM(**setting.llm_kwargs(), **llm_kwargs)
    finally:
        linear._dense_kernels = kernels


class Unsupported(Exception):
    """The engine refused to build this setting; the message is the one line the report prints."""


def with_llm(setting: PrecisionSetting, use: Callable[[Any], T], **llm_kwargs: Any) -> T:
    """Build the setting's engine, hand it to ``use``, free it; a refused construction raises ``Unsupported``."""
    try:
        llm = build_llm(setting, **llm_kwargs)
    except Exception as error:  # any refusal: TypeError for an unknown keyword, ValueError for a value
        raise Unsupported(f"unsupported: {type(error).__name__}: {error}") from error
    try:
        return use(llm)
    finally:
        del llm
        gc.collect()


def failure_line(error: BaseException) -> str:
    """What the report prints for a setting that did not produce figures."""
    if isinstance(error, Unsupported):
        return str(error)
    last = traceback.format_exception_only(type(error), error)[-1].strip()
    return f"failed: {last}"
