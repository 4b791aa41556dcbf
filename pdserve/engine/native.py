"""Compiles the engine's C kernels once per machine into the cache dir; ctypes loads them.

Each kernel is one C file (in ``pdserve/engine/kernels/``, with the headers and kernels it includes beside it) compiled with the system compiler into
``<pdserve cache dir>/kernels/``. The file name carries a hash of the source,
the compiler and flags, and the CPU's model and feature flags, so a changed
source or another CPU never loads a stale build. Callers treat ``OSError`` as
"no kernel here" and keep their pure-torch path.

A kernel that splits its work over threads does it with OpenMP on torch's own
runtime (``torch_openmp_flags``): linked against the very libgomp torch has
loaded, so the kernel's parallel regions run on the worker threads torch's
GEMMs just used, instead of a second pool of threads fighting them for the cores.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

from pdserve.engine.default_model import default_cache_dir

# -march=native is safe because the cached file is keyed by this CPU's feature flags.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11")
_BUILD_TIMEOUT_S = 120
_build_lock = threading.Lock()


def compile_kernel(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library built from ``source`` for this machine, building it if needed; OSError where it cannot be.

    ``extra_flags`` go after the source (link flags such as ``torch_openmp_flags()``; ``-fopenmp``;
    ``-mno-avx512vnni`` for a test of a fallback path) and into the build's key.
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC, or install gcc)")
    # Every file beside the source is part of the build's key: the shared header (vector.h), and the
    # kernels a source includes whole (fused_decode.c includes the others).
    text = source.read_bytes() + b"".join(
        other.read_bytes() for other in sorted(source.parent.glob("*.[ch]")) if other != source
    )
    flags = " ".join((compiler, *CFLAGS, *extra_flags)).encode()
    key = hashlib.sha256(text + flags + _cpu_identity()).hexdigest()[:16]
    directory = default_cache_dir() / "kernels"
    target = directory / f"{source.stem}-{key}.so"
    with _build_lock:
        if target.is_file():
            return target
        directory.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: concurrent builders never see half a file.
        fd, temp_name = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=directory)
        os.close(fd)
        try:
            try:
                result = subprocess.run(
                    [compiler, *CFLAGS, "-I", str(source.parent), "-o", temp_name, str(source), *extra_flags],
                    capture_output=True,
                    text=True,
                    timeout=_BUILD_TIMEOUT_S,
                )
            except subprocess.SubprocessError as error:
                raise OSError(f"{compiler} did not finish: {error}") from error
            if result.returncode != 0:
                raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
            os.replace(temp_name, target)
        finally:
            if os.path.exists(temp_name):
                os.unlink(temp_name)
    return target


def torch_openmp_flags() -> tuple[str, ...] | None:
    """Flags that build a kernel's ``#pragma omp`` regions on the OpenMP runtime torch itself uses; None without one.

    ``-fopenmp`` compiles the pragmas; linking the libgomp file that torch has
    loaded (found in this process's memory map), rather than the compiler's own,
    makes the library's ``libgomp.so.1`` dependency resolve to the copy already in
    the process, so one thread pool serves torch and the kernel. A torch on another
    OpenMP runtime (Intel's, LLVM's) or on none gets None: callers build without
    OpenMP and split their work themselves.
    """
    import torch  # noqa: F401  (loads torch's OpenMP runtime, if it has one, before the map is read)

    libgomp = _loaded_library("libgomp")
    if libgomp is None:
        return None
    return ("-fopenmp", str(libgomp), f"-Wl,-rpath,{libgomp.parent}")


def _loaded_library(stem: str) -> Path | None:
    """The file of a shared library this process has mapped whose name starts with ``stem`` (``libgomp``)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                # auditwheel renames bundled libraries (libgomp-a34b3233.so.1).
                name = Path(path).name
                if path.startswith("/") and (name.startswith(f"{stem}.so") or name.startswith(f"{stem}-")):
                    return Path(path)
    except OSError:
        pass
    return None


def _cpu_identity() -> bytes:
    """The CPU's model and feature flags, so that a build for another CPU is never loaded."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
    except OSError:
        pass
    return flags.encode()


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


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware: ``amx_bf16`` or ``avx512_bf16`` in /proc/cpuinfo (Linux x86).

    Elsewhere oneDNN emulates bf16 products: 3-10x slower than float32 at 32-2,048 rows on an AVX2-only
    AMD EPYC (Zen 3; benchmarks/linear_methods.py, BENCHMARKS.md)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
