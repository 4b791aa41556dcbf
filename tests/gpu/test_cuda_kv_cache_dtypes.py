"""Compact KV caches on CUDA: int8 / bf16 KV through SDPA, exact across a handoff; flash-attn refuses int8 KV.

Marked ``gpu``; skipped where CUDA is absent (every CI machine), run on a lent GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.support.handoff import handoff_tokens, prefill_and_hold

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _llm(path: Path, kv_cache_dtype: str, dtype: str = "float32") -> LLM:
    return LLM(model=str(path), dtype=dtype, device="cuda", num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype,
               attention_backend="auto")


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float32", "int8"), ("bfloat16", "int8"), ("float32", "bfloat16")])
def test_cuda_kv_handoff_equals_the_same_kv_dtype_in_process(
    llama_checkpoint: Path, dtype: str, kv_cache_dtype: str
) -> None:
    prompts = random_prompts([1, 16, 37, 150], seed=34)
    reference = _llm(llama_checkpoint, kv_cache_dtype, dtype)
    assert reference.engine.runner.backend.name == "sdpa"  # flash-attn reads only the model's dtype
    expected = [out.token_ids for out in reference.generate(prompts, GREEDY)]
    prefill, decode = _llm(llama_checkpoint, kv_cache_dtype, dtype).engine, _llm(llama_checkpoint, kv_cache_dtype, dtype).engine
    held = prefill_and_hold(prefill, prompts[0], GREEDY)
    blocks = prefill.leases.export(held.request_id, 0)
    assert blocks.device.type == "cuda" and blocks.dtype == decode.kv_cache.dtype
    assert prefill.leases.release(held.request_id)
    outputs = handoff_tokens(prefill, decode, prompts, GREEDY)
    # req-0 was the look at the held blocks above.
    assert [outputs[f"req-{i}"] for i in range(1, 5)] == expected


def test_flash_attn_refuses_a_kv_dtype_other_than_the_models(llama_checkpoint: Path) -> None:
    pytest.importorskip("flash_attn")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=str(llama_checkpoint), dtype="bfloat16", device="cuda", num_kv_blocks=64, kv_cache_dtype="int8",
            attention_backend="flash_attn")
