"""``pdserve bench``: drive a running server with streamed requests and report serving metrics.

The metrics are those of ``vllm bench serve`` (TTFT, TPOT, ITL, end-to-end
latency, throughputs, goodput), plus the prefix-cache hit rate.

Layout, one role per module: ``workload`` and ``dataset`` (what is sent),
``arrivals`` (when), ``backend`` and ``grpc_backend`` (how), ``runner`` (one
record per request), ``record`` and ``metrics`` (pure arithmetic on records),
``report`` and ``plots`` (tables, JSON, PNG), ``config`` and ``cli`` (options).
"""

from __future__ import annotations

from pdserve.bench.cli import add_bench_arguments, run_bench

__all__ = ["add_bench_arguments", "run_bench"]
