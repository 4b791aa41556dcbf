"""The engine's CPU kernels, built into the package: which ISA variant runs here, and the operators.

``setup.py`` compiles the C kernels in ``pdserve/engine/kernels/`` once per ISA
variant (``VARIANTS``) and links them, with their torch operators
(``kernels/ops.cpp``), into one library, ``pdserve.engine.kernels._C``. Nothing
is compiled at run time. ``load_kernel_ops`` loads that library once and picks
the variant: the best one this CPU has every feature of (``VARIANT_FEATURES``),
or the one ``PDSERVE_CPU_ISA`` names (``portable``, ``avx2``, ``avx512``,
``avx512_vnni``, ``avx512_bf16``), as PyTorch's ``ATEN_CPU_CAPABILITY`` does, to
measure a lower variant on a bigger CPU. Callers pass ``KernelOps.variant``
with every call (``torch.ops.pdserve.<op>(variant, ...)``): nothing is global, so
tests run several variants side by side. A package built without the kernels
(``PDSERVE_BUILD_KERNELS=0``) gets None, and the engine its pure-torch paths.

The kernels split their work with OpenMP, linked against the runtime torch
has loaded (the library needs ``libgomp.so.1``, which torch's own copy
satisfies), so their parallel regions run on the threads torch's GEMMs use.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

logger = logging.getLogger(__name__)

# The variants ops.cpp numbers, worst first, and the CPU features (as /proc/cpuinfo names them) each needs:
# the flags setup.py compiles it with (x86-64-v3 and -v4, plus VNNI and BF16).
_X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
VARIANT_FEATURES: dict[str, frozenset[str]] = {
    "portable": frozenset(),
    "avx2": _X86_64_V3,
    "avx512": _X86_64_V4,
    "avx512_vnni": _X86_64_V4 | {"avx512_vnni"},
    "avx512_bf16": _X86_64_V4 | {"avx512_vnni", "avx512_bf16"},
}
VARIANTS = tuple(VARIANT_FEATURES)
# Names a variant to run instead of the best one (a lower one, to measure it on a bigger CPU).
ISA_ENV = "PDSERVE_CPU_ISA"


@dataclass(frozen=True)
class KernelOps:
    """The kernels' operators and the variant to pass them: ``ops.<name>(variant, ...)``."""

    ops: Any  # torch.ops.pdserve
    variant: int  # its index in ``built_variants()``
    name: str


def built_variants() -> tuple[str, ...]:
    """The variants this package's library holds (every x86 one on x86, portable elsewhere); () without it."""
    ops = _load_library()
    return tuple(ops.variants().split(",")) if ops is not None else ()


def supported_variants() -> tuple[str, ...]:
    """The built variants this CPU can run, worst first."""
    flags = cpu_flags()
    return tuple(name for name in built_variants() if VARIANT_FEATURES.get(name, frozenset()) <= flags)


def load_kernel_ops(variant: str | None = None) -> KernelOps | None:
    """The kernels' operators at ``variant`` (None: ``PDSERVE_CPU_ISA``'s, else the best this CPU runs); None
    when this package was built without them. ``ValueError`` for a variant that is not built or that this CPU
    cannot run (naming ``PDSERVE_CPU_ISA`` when it came from there)."""
    ops = _load_library()
    if ops is None:
        return None
    source = "variant"
    if variant is None and os.environ.get(ISA_ENV):
        variant, source = os.environ[ISA_ENV], ISA_ENV
    supported = supported_variants()
    if variant is None:
        variant = supported[-1]
    if variant not in supported:
        built = built_variants()
        reason = "is not one of the built variants" if variant not in built else "needs CPU features this CPU lacks"
        raise ValueError(f"{source} {variant!r} {reason}; this CPU runs {', '.join(supported)}")
    return KernelOps(ops, built_variants().index(variant), variant)


@lru_cache(maxsize=1)
def _load_library() -> Any | None:
    """torch.ops.pdserve with the kernels' library loaded; None (logged once) where the package has none."""
    import torch

    spec = importlib.util.find_spec("pdserve.engine.kernels._C")
    if spec is None or spec.origin is None:
        logger.warning("pdserve was built without its CPU kernels (PDSERVE_BUILD_KERNELS=0, or no build); "
                       "the engine runs torch's ops instead, slower on CPU")
        return None
    torch.ops.load_library(spec.origin)
    return torch.ops.pdserve


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (Linux x86); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """This CPU's vendor as /proc/cpuinfo names it ("AuthenticAMD", "GenuineIntel"); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return ""


# The vector and matrix features a forced variant hides from the engine's choices (dispatch_flags).
_SIMD_PREFIXES = ("avx", "amx", "fma", "f16c", "vpclmul", "vaes", "gfni")


def dispatch_flags() -> frozenset[str]:
    """The CPU flags the engine's choices read: ``cpu_flags()``, less the vector and matrix features beyond the
    variant ``PDSERVE_CPU_ISA`` forces. With ``PDSERVE_CPU_ISA=avx2`` on an AVX-512/AMX CPU the engine then
    chooses as on an AVX2-only one (float32 dequantized GEMMs, no bf16 or AMX paths), not only its kernels'
    variant. Libraries have their own switches for the same (docs/performance.md: emulating a smaller CPU)."""
    flags = cpu_flags()
    forced = os.environ.get(ISA_ENV)
    if not forced or forced not in VARIANT_FEATURES:
        return flags
    allowed = VARIANT_FEATURES[forced]
    return frozenset(f for f in flags if f in allowed or not f.startswith(_SIMD_PREFIXES))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware: ``amx_bf16`` or ``avx512_bf16`` among ``dispatch_flags()``.

    Elsewhere oneDNN emulates bf16 products: 3-10x slower than float32 at 32-2,048 rows on an AVX2-only
    AMD EPYC (Zen 3; benchmarks/linear_methods.py, BENCHMARKS.md)."""
    return bool({"amx_bf16", "avx512_bf16"} & dispatch_flags())
