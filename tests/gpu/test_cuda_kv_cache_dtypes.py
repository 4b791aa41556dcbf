"""Compact KV caches on CUDA: int8 / bf16 KV through SDPA, exact across a handoff; flash-attn refuses int8 KV.

Marked ``gpu``; skipped where CUDA is absent (every CI machine), run on a lent GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import random_prompts

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
    for prompt in prompts:
        request_id = prefill.add_request(prompt, GREEDY)
        (first,) = prefill.step()
        kv = prefill.export_kv(request_id)
        assert kv.blocks.device.type == "cuda" and kv.blocks.dtype == decode.kv_cache.dtype
        prefill.abort_request(request_id)
        assert decode.import_request(request_id, prompt, first.token_ids[0], GREEDY, kv)
    outputs: dict[str, list[int]] = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert [outputs[f"req-{i}"] for i in range(len(prompts))] == expected


def test_flash_attn_refuses_a_kv_dtype_other_than_the_models(llama_checkpoint: Path) -> None:
    pytest.importorskip("flash_attn")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=str(llama_checkpoint), dtype="bfloat16", device="cuda", num_kv_blocks=64, kv_cache_dtype="int8",
            attention_backend="flash_attn")
