"""The paths the engine takes by CPU, forced in tests, so that one machine checks every CPU kind's.

Two things differ between the CPUs the project runs on (a Zen 3, a Zen 4 or 5, a Xeon with AMX):

- the kernels' ISA variant (``PDSERVE_CPU_ISA``): ``variant_params`` makes each one a test parameter, the ones
  this machine cannot run skipped with the CPU features it lacks, never left out;
- the engine's choices, which read the CPU's vendor and ``dispatch_flags()``: where float32 GEMMs run (MKL, or
  pdserve's panels on AMD with AVX-512), how many rows the INT8/INT4 kernels take, whether quantized layers
  dequantize to bf16 or float32. ``emulate`` makes them as on a ``CpuKind``; the kernels still run in a variant
  this machine has, and every variant gives the same bits (tests/unit/test_*kernel*.py), so what a Xeon or a
  Zen 4 computes is what the test sees. MKL's own code paths (its AVX-512 ones on Intel) are the exception.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from pdserve.engine import native
from pdserve.engine.layers import dense_kernels, linear
from pdserve.engine.native import VARIANT_FEATURES, VARIANTS, built_variants, cpu_flags


def missing_reason(variant: str) -> str | None:
    """Why ``variant`` cannot run here (not in this build, or the CPU features it lacks, by name); None where it can."""
    if variant not in built_variants():
        built = ", ".join(built_variants()) or "none: pdserve was built without its CPU kernels"
        return f"{variant} is not in this build of the kernels (built: {built})"
    lacking = sorted(VARIANT_FEATURES[variant] - cpu_flags())
    if lacking:
        return f"{variant} needs CPU features this CPU lacks: {', '.join(lacking)}"
    return None


def variant_params(
    variants: tuple[str, ...] = VARIANTS, values: Callable[[str], tuple[Any, ...]] | None = None
) -> list[Any]:
    """``pytest.param`` per variant (its name, or ``values(name)``), id the name; a variant this machine cannot run
    is a skip naming why (``missing_reason``), never left out."""
    params = []
    for variant in variants:
        reason = missing_reason(variant)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        args = values(variant) if values is not None else (variant,)
        params.append(pytest.param(*args, id=variant, marks=marks))
    return params


@dataclass(frozen=True)
class CpuKind:
    """A CPU the project runs on, as the engine's choices see it: /proc/cpuinfo's vendor and flags."""

    name: str
    vendor: str
    flags: frozenset[str]


_AMX = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
CPU_KINDS = (
    # AVX2 only: float32 GEMMs in MKL, the INT8 kernel up to 512 rows (INT4 at every row count), float32 dequantized.
    CpuKind("zen3", "AuthenticAMD", VARIANT_FEATURES["avx2"]),
    # AVX-512 with VNNI and BF16 (a Zen 5 chooses alike): float32 and bf16 GEMMs in pdserve's panels, the
    # quantized kernels at every row count.
    CpuKind("zen4", "AuthenticAMD", VARIANT_FEATURES["avx512_bf16"]),
    # AMX tiles: float32 GEMMs in MKL, bf16 ones in oneDNN, the quantized kernels up to 256 rows and above them
    # weights dequantized to bf16 (activations rounded to bf16).
    CpuKind("xeon_amx", "GenuineIntel", VARIANT_FEATURES["avx512_bf16"] | _AMX),
)


def emulate(monkeypatch: pytest.MonkeyPatch, kind: CpuKind) -> None:
    """Make the engines built from here on choose their paths as on ``kind`` (undone with ``monkeypatch``)."""
    flags: Callable[[], frozenset[str]] = lambda: kind.flags  # noqa: E731
    # native.cpu_has_native_bf16 (which linear and llm_engine import) reads native.dispatch_flags.
    monkeypatch.setattr(native, "dispatch_flags", flags)
    monkeypatch.setattr(linear, "dispatch_flags", flags)
    monkeypatch.setattr(dense_kernels, "dispatch_flags", flags)
    monkeypatch.setattr(dense_kernels, "cpu_vendor", lambda: kind.vendor)


def cpu_kind_params() -> list[Any]:
    """``pytest.param`` per ``CPU_KINDS`` entry, id its name."""
    return [pytest.param(kind, id=kind.name) for kind in CPU_KINDS]
