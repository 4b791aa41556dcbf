"""The two Hugging Face transformers baselines: static batches with ``generate`` and ``generate_batch``.

Both run greedy decoding on the same model object, loaded from the same folder
pdserve loads, in the dtype and on the device pdserve runs (float32 on the CPU by
default). EOS is switched off rather than suppressed, to match
pdserve's ``ignore_eos=True``: a greedy EOS is emitted and decoding goes on.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from benchmarks.workload import RunResult, Workload, timed


def load_hf_model(model_path: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """The reference model with SDPA attention, its EOS switched off for generation."""
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).to(device)
    model.eval()
    # generate() fills every generation-config field left at None from model.generation_config,
    # so EOS must be cleared here: with it unset, generate neither stops at EOS nor (as
    # min_new_tokens would) masks it out of the greedy choice.
    model.generation_config.eos_token_id = None
    return model


def pad_token_id(model: Any) -> int:
    pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


def run_hf_static(model: Any, workload: Workload, batch_size: int, name: str = "hf_static") -> RunResult:
    """``model.generate`` over consecutive batches of ``batch_size`` prompts, left-padded to the batch's longest."""
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=workload.output_len,
        # Redundant with EOS switched off; kept so that a checkpoint whose EOS cannot be
        # cleared still never stops early.
        min_new_tokens=workload.output_len,
        pad_token_id=pad_token_id(model),
    )

    def run() -> list[tuple[int, ...]]:
        token_ids: list[tuple[int, ...]] = []
        for start in range(0, len(workload.prompts), batch_size):
            batch = workload.prompts[start : start + batch_size]
            token_ids.extend(_generate_left_padded(model, batch, config))
        return token_ids

    with torch.inference_mode(), same_attention_kernels(model):
        token_ids, wall_s = timed(run)
    return RunResult(name=name, wall_s=wall_s, token_ids=tuple(token_ids), details={"batch_size": batch_size})


def _generate_left_padded(
    model: Any, batch: tuple[tuple[int, ...], ...], config: GenerationConfig
) -> list[tuple[int, ...]]:
    padded_len = max(len(prompt) for prompt in batch)
    input_ids = torch.full((len(batch), padded_len), config.pad_token_id, dtype=torch.long)  # (batch, padded_len)
    attention_mask = torch.zeros((len(batch), padded_len), dtype=torch.long)
    for row, prompt in enumerate(batch):
        input_ids[row, padded_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, padded_len - len(prompt) :] = 1
    output = model.generate(
        input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device), generation_config=config
    )
    generated = output[:, padded_len:]  # (batch, generated_len)
    # Every row runs to max_new_tokens here; a row that stopped early would be padded,
    # and its padding must not be counted as generated.
    eos = model.generation_config.eos_token_id
    return [_trim_after_eos(row.tolist(), eos) for row in generated]


def _trim_after_eos(token_ids: list[int], eos_token_id: int | list[int] | None) -> tuple[int, ...]:
    if eos_token_id is None:
        return tuple(token_ids)
    eos_ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    for position, token_id in enumerate(token_ids):
        if token_id in eos_ids:
            return tuple(token_ids[: position + 1])
    return tuple(token_ids)


def continuous_batching_config(
    workload: Workload, page_size: int, max_batch_tokens: int, max_requests_per_batch: int
) -> ContinuousBatchingConfig:
    """Sized like pdserve's run: the same page size and token budget, and a cache that holds every request at once.

    Set explicitly because the automatic sizing reads free GPU memory.
    """
    pages_needed = sum(math.ceil((len(p) + workload.output_len) / page_size) for p in workload.prompts)
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=pages_needed + len(workload.prompts),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
    )


def same_attention_kernels(model: Any) -> contextlib.AbstractContextManager[object]:
    """On CUDA, SDPA's kernels as pdserve's engine chooses them (no cuDNN attention), so neither side
    pays cuDNN's graph build for every new sequence length; nothing on the CPU."""
    if model.device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    from pdserve.engine.attention.sdpa import CUDA_SDPA_BACKENDS

    return sdpa_kernel(CUDA_SDPA_BACKENDS)


def run_hf_continuous(
    model: Any, workload: Workload, cb_config: ContinuousBatchingConfig, name: str = "hf_continuous"
) -> RunResult:
    """``model.generate_batch``: transformers' own paged-cache continuous batching, all prompts submitted at once.

    Each call builds its manager and cache afresh, so ``wall_s`` includes that set-up,
    as it does for any caller of ``generate_batch``.
    """
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=workload.output_len,
        # -1 is generate_batch's documented "no EOS": requests end only at max_new_tokens.
        eos_token_id=-1,
        pad_token_id=pad_token_id(model),
    )

    def run() -> dict[str, Any]:
        return model.generate_batch(
            inputs=workload.prompt_lists(), generation_config=config, continuous_batching_config=cb_config
        )

    with torch.inference_mode(), same_attention_kernels(model):
        outputs, wall_s = timed(run)
    # generate_batch returns results keyed by request id in input order; it logs and
    # drops failed requests rather than raising, so check that every prompt came back.
    results = list(outputs.values())
    failed = [r.request_id for r in results if r.error is not None]
    if len(results) != len(workload.prompts) or failed:
        raise RuntimeError(
            f"generate_batch returned {len(results)} of {len(workload.prompts)} requests; failed: {failed}"
        )
    return RunResult(
        name=name,
        wall_s=wall_s,
        token_ids=tuple(tuple(r.generated_tokens) for r in results),
        details={
            "attn_implementation": model.config._attn_implementation,
            "page_size": cb_config.page_size,
            "num_blocks": cb_config.num_blocks,
            "max_batch_tokens": cb_config.max_batch_tokens,
        },
    )
