"""pdserve's side of the benchmark: one ``LLM.generate`` over all prompts, and a prefill-only pass."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchmarks.workload import RunResult, Workload, timed

if TYPE_CHECKING:
    from pdserve.engine import SamplingParams


@dataclass(frozen=True)
class PdserveSettings:
    """The ``LLM`` constructor arguments the benchmark exposes on its command line."""

    model: str | None
    block_size: int
    num_kv_blocks: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    attention_backend: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"


def run_pdserve(
    settings: PdserveSettings, workload: Workload, warmup: Workload, name: str = "pdserve"
) -> RunResult:
    """Build a fresh ``LLM``, warm it up, then time one ``generate`` over the whole workload.

    A fresh engine per call keeps the prefix cache empty: a second pass over the same
    prompts on the same engine would be served from it and time nothing but decode.
    The engine is imported here, not at the top, so that ``--skip-pdserve`` runs the
    Hugging Face baselines even while the engine does not import.
    """
    from pdserve.engine import LLM

    llm, setup_s = timed(
        lambda: LLM(
            model=settings.model,
            dtype=settings.dtype,
            device=settings.device,
            block_size=settings.block_size,
            num_kv_blocks=settings.num_kv_blocks,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_prefix_caching=settings.enable_prefix_caching,
            attention_backend=settings.attention_backend,
        )
    )
    try:
        llm.generate(warmup.prompt_lists(), _greedy(warmup.output_len))
        cpu_started, started = time.process_time(), time.monotonic()
        outputs, wall_s = timed(lambda: llm.generate(workload.prompt_lists(), _greedy(workload.output_len)))
        cpu_s, ended = time.process_time() - cpu_started, time.monotonic()
    finally:
        # Two engines' KV pools need not be alive at once.
        del llm
        gc.collect()
    return RunResult(
        name=name,
        wall_s=wall_s,
        token_ids=tuple(tuple(o.token_ids) for o in outputs),
        setup_s=setup_s,
        details={
            "num_cached_tokens": sum(o.num_cached_tokens for o in outputs),
            # Every thread of this process over the timed generate: the engine's CPU time.
            "cpu_s": cpu_s,
            # The timed generate on time.monotonic(), the clock engine step traces use.
            "started_monotonic": started,
            "ended_monotonic": ended,
            "finish_reasons": sorted({str(o.finish_reason) for o in outputs}),
        },
    )


def _greedy(max_tokens: int) -> SamplingParams:
    from pdserve.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
