"""What one core can issue at most of each kernel's inner multiply-add, against float32's FMA.

``python -m benchmarks.instruction_peaks``

Register-only loops (benchmarks/native/instruction_peaks.c, compiled here with the system ``cc``: a
benchmark's tool, never the engine's) of the products pdserve's quantized kernels are made of, one thread:

- ``f32 avx2``: ``vfmadd231ps`` on 256 bits, what float32 GEMMs run on an AVX2-only CPU;
- ``int8 avx2``: ``vpsignb`` + ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``, the AVX2 INT8 kernel's signed
  int8 dot product (no VNNI);
- ``int4 avx2``: the AVX2 INT4 kernel's nibble unpack and two ``vpmaddubsw`` summed in 16 bits;
- ``f32 avx512`` and ``int8 vnni`` (``vpdpbusd``) where the CPU has them.

Each figure is giga multiply-adds a second on one core, the best of ``--repeats``; the ratios to float32
on the same vector width bound what an INT8 or INT4 GEMM can gain over a float32 one where both are
compute-bound (prefill, and decode batches whose weights stay in cache): BENCHMARKS.md uses them for
the AVX2 variant's W1 targets.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

from pdserve.engine.native import cpu_flags

SOURCE = Path(__file__).with_name("native") / "instruction_peaks.c"
ITERATIONS = 20_000_000
# The independent chains of each loop (CHAINS in the C file).
CHAINS = 12
# name: (C function, multiply-adds per chain and round, CPU flags it needs, result type)
PEAKS = {
    "f32 avx2": ("peak_f32_avx2", 8, {"avx2", "fma"}, ctypes.c_float),
    "int8 avx2": ("peak_int8_avx2", 32, {"avx2"}, ctypes.c_int32),
    "int4 avx2": ("peak_int4_avx2", 64, {"avx2"}, ctypes.c_int32),
    "f32 avx512": ("peak_f32_avx512", 16, {"avx512f"}, ctypes.c_float),
    "int8 vnni": ("peak_int8_vnni", 64, {"avx512f", "avx512_vnni"}, ctypes.c_int32),
}


def build(folder: Path) -> ctypes.CDLL:
    library = folder / "instruction_peaks.so"
    subprocess.run(["cc", "-O3", "-shared", "-fPIC", "-o", str(library), str(SOURCE)], check=True)
    return ctypes.CDLL(str(library))


def measure(library: ctypes.CDLL, repeats: int) -> dict[str, float]:
    """GMAC/s per core of every loop this CPU runs, the best of ``repeats`` rounds that alternate the loops (a
    noisy neighbour slows a round, not one loop)."""
    flags = cpu_flags()
    functions = {}
    for name, (symbol, macs, needs, result) in PEAKS.items():
        if needs <= flags:
            function = getattr(library, symbol)
            function.restype, function.argtypes = result, [ctypes.c_int64]
            function(ITERATIONS // 10)  # warm-up: clocks up, code paged in
            functions[name] = (function, macs * CHAINS)
    best = dict.fromkeys(functions, float("inf"))
    for _ in range(repeats):
        for name, (function, _) in functions.items():
            start = time.perf_counter()
            function(ITERATIONS)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: macs * ITERATIONS / best[name] / 1e9 for name, (_, macs) in functions.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rates = measure(build(Path(folder)), args.repeats)
    for name, rate in rates.items():
        base = "f32 avx512" if name == "int8 vnni" else "f32 avx2"
        ratio = f"  {rate / rates[base]:.2f}x {base}" if base in rates and name != base else ""
        print(f"{name:>11}: {rate:7.1f} GMAC/s per core{ratio}")


if __name__ == "__main__":
    main()
