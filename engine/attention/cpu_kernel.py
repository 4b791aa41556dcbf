"""Builds and calls the paged decode-attention C kernel (``kernels/paged_decode.c``) on CPUs.

The kernel is compiled once per machine with the system C compiler into
``<pdserve cache dir>/kernels/`` (the file name carries a hash of the source,
the flags and the CPU's feature flags, so a changed source or a different CPU
never loads a stale build) and loaded with ctypes. Without a compiler, or when
the build fails, ``load_paged_decode_kernel`` returns None and the engine keeps
the pure-torch SDPA path; nothing else depends on the kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch

from engine.default_model import default_cache_dir
from engine.kv_cache import QuantizedKV

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels") / "paged_decode.c"
# -march=native is safe because the cached file is keyed by this CPU's feature flags.
_CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared", "-std=c11")
_SYMBOL = "pdserve_paged_decode_attention"
# One symbol per KV dtype; int8 takes two more pointers (the key and value scales).
_SYMBOLS = {torch.float32: _SYMBOL, torch.bfloat16: _SYMBOL + "_bf16", torch.int8: _SYMBOL + "_int8"}
# The KV dtypes the kernel reads; queries may be float32 or bfloat16 (computed in float32).
KERNEL_KV_DTYPES = tuple(_SYMBOLS)
KERNEL_QUERY_DTYPES = (torch.float32, torch.bfloat16)
_BUILD_TIMEOUT_S = 120


class PagedDecodeKernel:
    """Decode attention over the paged cache for a batch of single-token queries, CPU, float32 arithmetic.

    The cache may be float32, bfloat16 or int8 (a ``QuantizedKV`` with its
    scales); the output has the query's dtype.

    ``num_threads`` calls of the kernel run side by side on disjoint ranges of
    sequences chosen to balance their context lengths; ctypes releases the GIL
    for each, so they run in parallel.
    """

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self._functions = {dtype: getattr(library, symbol) for dtype, symbol in _SYMBOLS.items()}
        self.num_threads = max(1, num_threads)
        self._pool = ThreadPoolExecutor(self.num_threads - 1, "pdserve-attn") if self.num_threads > 1 else None

    def split_points(self, context_lens: list[int]) -> list[int]:
        """Boundaries of up to ``num_threads`` contiguous sequence ranges of about equal total context."""
        total = sum(context_lens)
        points = [0]
        running = 0
        for index, length in enumerate(context_lens):
            running += length
            if len(points) < self.num_threads and running * self.num_threads >= total * len(points) and index + 1 < len(context_lens):
                points.append(index + 1)
        points.append(len(context_lens))
        return points

    def __call__(
        self,
        query: torch.Tensor,  # (num_seqs, num_heads, head_dim)
        key_cache: torch.Tensor | QuantizedKV,  # (num_blocks, block_size, num_kv_heads, head_dim)
        value_cache: torch.Tensor | QuantizedKV,
        block_tables: torch.Tensor,  # (num_seqs, max_blocks) int64
        context_lens: torch.Tensor,  # (num_seqs,) int64
        split_points: list[int],
        scale: float,
    ) -> torch.Tensor:  # (num_seqs, num_heads, head_dim)
        num_seqs, num_heads, head_dim = query.shape
        quantized = isinstance(key_cache, QuantizedKV)
        key_data = key_cache.data if isinstance(key_cache, QuantizedKV) else key_cache
        value_data = value_cache.data if isinstance(value_cache, QuantizedKV) else value_cache
        _, block_size, num_kv_heads, _ = key_data.shape
        kv_dtype = key_data.dtype
        if kv_dtype not in self._functions:
            raise ValueError(f"the paged decode kernel reads KV in {KERNEL_KV_DTYPES}, got {kv_dtype}")
        if quantized != (kv_dtype == torch.int8) or isinstance(value_cache, QuantizedKV) != quantized:
            raise ValueError("int8 key_cache and value_cache must both be QuantizedKV (data with scales)")
        checks = [
            ("key_cache", key_data, kv_dtype),
            ("value_cache", value_data, kv_dtype),
            ("block_tables", block_tables, torch.int64),
            ("context_lens", context_lens, torch.int64),
        ]
        if isinstance(key_cache, QuantizedKV) and isinstance(value_cache, QuantizedKV):
            checks += [("key_scales", key_cache.scales, torch.float32), ("value_scales", value_cache.scales, torch.float32)]
        # The C side trusts these layouts; anything else would read the wrong memory.
        for name, tensor, dtype in checks:
            if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor")
        query_dtype = query.dtype
        query = query.to(torch.float32).contiguous()
        out = torch.empty_like(query)
        args: tuple[int, ...] = (out.data_ptr(), query.data_ptr(), key_data.data_ptr(), value_data.data_ptr())
        if isinstance(key_cache, QuantizedKV) and isinstance(value_cache, QuantizedKV):
            args += (key_cache.scales.data_ptr(), value_cache.scales.data_ptr())
        args += (block_tables.data_ptr(), context_lens.data_ptr())
        function = self._functions[kv_dtype]
        shape = (block_tables.shape[1], num_kv_heads, num_heads // num_kv_heads, head_dim, block_size, scale)
        ranges = list(zip(split_points[:-1], split_points[1:]))
        pending = []
        if self._pool is not None:
            pending = [self._pool.submit(function, *args, begin, end, *shape) for begin, end in ranges[1:]]
            ranges = ranges[:1]
        statuses = [function(*args, begin, end, *shape) for begin, end in ranges]
        statuses += [future.result() for future in pending]
        if any(status != 0 for status in statuses):
            raise MemoryError("paged decode attention kernel could not allocate its score buffer")
        return out.to(query_dtype)


_build_lock = threading.Lock()


def load_paged_decode_kernel(num_threads: int | None = None) -> PagedDecodeKernel | None:
    """The compiled kernel, building it on first use; None where it cannot be built on this machine."""
    library = _load_library()
    if library is None:
        return None
    return PagedDecodeKernel(library, num_threads if num_threads is not None else torch.get_num_threads())


@lru_cache(maxsize=1)
def _load_library() -> ctypes.CDLL | None:
    with _build_lock:
        try:
            path = _build()
        except (OSError, subprocess.SubprocessError) as error:
            logger.warning("CPU paged-attention kernel unavailable (%s); decode attention uses SDPA", error)
            return None
        library = ctypes.CDLL(str(path))
        for dtype, symbol in _SYMBOLS.items():
            function = getattr(library, symbol)
            function.restype = ctypes.c_int
            num_pointers = 8 if dtype == torch.int8 else 6
            function.argtypes = [ctypes.c_void_p] * num_pointers + [ctypes.c_int64] * 7 + [ctypes.c_float]
        return library


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC, or install gcc)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((compiler, *_CFLAGS)).encode() + _cpu_identity()).hexdigest()[:16]
    directory = default_cache_dir() / "kernels"
    target = directory / f"paged_decode-{key}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent builders never see half a file.
    fd, temp_name = tempfile.mkstemp(prefix=".paged_decode-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *_CFLAGS, "-o", temp_name, str(_SOURCE)],
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(temp_name, target)
    finally:
        if os.path.exists(temp_name):
            os.unlink(temp_name)
    return target


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
