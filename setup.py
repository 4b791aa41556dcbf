"""Builds the engine's CPU kernels into the package (pyproject.toml holds everything else).

The C kernels in pdserve/engine/kernels/ are compiled once per ISA variant, each with its own flags, and
linked with ops.cpp (their torch operators) into one library, pdserve/engine/kernels/_C: the engine picks
the best variant the CPU runs at start (pdserve/engine/native.py), or the one PDSERVE_CPU_ISA names.
Nothing is compiled at run time. The build needs torch's headers, so torch must be installed first and
the build must see it: ``pip install --no-build-isolation .`` (scripts/setup.sh and the Dockerfile do).
PDSERVE_BUILD_KERNELS=0 builds pdserve without them (the gateway's image, which has no torch).
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import setup

KERNELS = Path("pdserve/engine/kernels")
# Every variant's flags; the engine runs one only where the CPU has every feature it names
# (native.py's VARIANT_FEATURES). Best last, as ops.cpp lists them.
X86_VARIANTS = {
    "portable": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64-v3", "-mtune=generic"],
    "avx512": ["-march=x86-64-v4", "-mtune=generic"],
    "avx512_vnni": ["-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=generic"],
}
C_FLAGS = ["-O3", "-fno-math-errno", "-fPIC", "-std=gnu11", "-fopenmp", "-Wno-psabi"]


def _variants() -> dict[str, list[str]]:
    if platform.machine() in ("x86_64", "AMD64"):
        return X86_VARIANTS
    return {"portable": []}


def _kernel_extensions() -> tuple[list, dict]:
    if os.environ.get("PDSERVE_BUILD_KERNELS", "1") == "0":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        sys.exit(
            "pdserve: building the CPU kernels needs torch installed first, and a build that sees it:\n"
            "  pip install torch==2.13.0 && pip install --no-build-isolation .\n"
            "(PDSERVE_BUILD_KERNELS=0 builds pdserve without the kernels, as the gateway's image does.)"
        )

    class BuildKernels(BuildExtension):
        """Compiles each variant of the C kernels, and the OpenMP team helper, before linking them into _C."""

        def build_extension(self, ext) -> None:  # noqa: ANN001
            compiler = shlex.split(os.environ.get("CC", "cc"))
            out = Path(self.build_temp) / "pdserve_kernels"
            out.mkdir(parents=True, exist_ok=True)
            objects = []
            jobs = []
            for variant, flags in _variants().items():
                obj = out / f"kernels_{variant}.o"
                command = [*compiler, *C_FLAGS, *flags, f"-DPDSERVE_VARIANT={variant}", "-include",
                           str(KERNELS / "variant.h"), "-I", str(KERNELS), "-c", str(KERNELS / "fused_decode.c"),
                           "-o", str(obj)]
                jobs.append((variant, subprocess.Popen(command)))
                objects.append(str(obj))
            team = out / "openmp_team.o"
            jobs.append(("openmp_team", subprocess.Popen(
                [*compiler, *C_FLAGS, "-c", str(KERNELS / "openmp_team.c"), "-o", str(team)])))
            objects.append(str(team))
            for name, job in jobs:
                if job.wait() != 0:
                    raise RuntimeError(f"compiling the {name} kernels failed (see the compiler's output above)")
            ext.extra_objects = objects
            super().build_extension(ext)

    extension = CppExtension(
        "pdserve.engine.kernels._C",
        [str(KERNELS / "ops.cpp")],
        extra_compile_args={"cxx": ["-O2", "-fopenmp"]},
        extra_link_args=["-fopenmp"],
    )
    return [extension], {"build_ext": BuildKernels}


ext_modules, cmdclass = _kernel_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
