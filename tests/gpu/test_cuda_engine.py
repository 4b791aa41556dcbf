"""The engine on CUDA: SDPA in float32 equals transformers; flash-attn agrees with SDPA in bf16.

Marked ``gpu``; skipped where CUDA is absent (every CI machine), run on a lent GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import Oracle, random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = [1, 5, 16, 17, 40, 95, 160, 300]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def test_cuda_sdpa_float32_equals_transformers(llama_checkpoint: Path) -> None:
    oracle = Oracle(llama_checkpoint)
    prompts = random_prompts(LENGTHS, seed=31)
    llm = LLM(model=str(llama_checkpoint), dtype="float32", device="cuda", num_kv_blocks=256,
              attention_backend="sdpa", max_num_batched_tokens=64)
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == oracle.generate(prompt, 24)


def test_flash_attn_backend_matches_sdpa_in_bfloat16(llama_checkpoint: Path) -> None:
    pytest.importorskip("flash_attn")
    prompts = random_prompts(LENGTHS, seed=32)
    results = {}
    for backend in ("sdpa", "flash_attn"):
        llm = LLM(model=str(llama_checkpoint), dtype="bfloat16", device="cuda", num_kv_blocks=256,
                  attention_backend=backend, max_num_batched_tokens=64)
        results[backend] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        # Second pass: every prompt hits the prefix cache (gathered-context path).
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == results[backend]
    # bf16 kernels round differently; require agreement on the first 8 tokens of every prompt.
    for a, b in zip(results["sdpa"], results["flash_attn"]):
        assert a[:8] == b[:8]


def test_cuda_sdpa_leaves_cudnn_attention_out(llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # cuDNN builds a graph per new shape (hundreds of ms): prefill chunks of every length must not go there.
    from pdserve.engine.attention import sdpa

    enabled_at_call = []
    attend = sdpa.F.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        enabled_at_call.append(torch.backends.cuda.cudnn_sdp_enabled())
        return attend(*args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    llm = LLM(model=str(llama_checkpoint), dtype="bfloat16", device="cuda", num_kv_blocks=256,
              attention_backend="sdpa", max_num_batched_tokens=64)
    llm.generate(random_prompts([5, 40, 95], seed=35), SamplingParams(max_tokens=4, temperature=0.0))
    assert enabled_at_call and not any(enabled_at_call)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process's own setting is back


def test_cuda_logit_adjustments_and_prompt_logprobs_equal_the_cpu_engine(llama_checkpoint: Path) -> None:
    # Penalties, bias and min_tokens index and scatter on the device; prompt logprobs come from device logits.
    prompts = random_prompts([3, 40, 95, 160], seed=33)
    adjusted = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5,
                              presence_penalty=0.25, logit_bias={7: 30.0, 100: -2.0}, min_tokens=6, prompt_logprobs=3)
    params = [adjusted, GREEDY, adjusted, SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=0)]
    results = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=str(llama_checkpoint), dtype="float32", device=device, num_kv_blocks=256,
                  attention_backend="sdpa", max_num_batched_tokens=64)
        results[device] = llm.generate(prompts, params)
    for cpu, cuda in zip(results["cpu"], results["cuda"]):
        assert cuda.token_ids == cpu.token_ids
        if cpu.prompt_logprobs is None:
            assert cuda.prompt_logprobs is None
            continue
        assert cuda.prompt_logprobs is not None
        assert [e.token_id for e in cuda.prompt_logprobs] == [e.token_id for e in cpu.prompt_logprobs]
        assert [[t for t, _ in e.top] for e in cuda.prompt_logprobs] == [[t for t, _ in e.top] for e in cpu.prompt_logprobs]
        torch.testing.assert_close(torch.tensor([e.logprob for e in cuda.prompt_logprobs]),
                                   torch.tensor([e.logprob for e in cpu.prompt_logprobs]), rtol=0, atol=1e-4)
    # min_tokens held the boosted EOS back for exactly six tokens.
    assert [len(out.token_ids) for out in (results["cpu"][0], results["cpu"][2])] == [7, 7]


def test_cuda_int8_and_int4_weights_agree_with_float32(llama_checkpoint: Path) -> None:
    # On CUDA, quantized projections dequantize to bf16 per call (the int8 kernels are CPU only).
    prompts = random_prompts([40, 95, 160, 300], seed=33)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    top1 = {}
    for quantization in (None, "int8", "int4"):
        llm = LLM(model=str(llama_checkpoint), dtype="float32", device="cuda", num_kv_blocks=256,
                  attention_backend="sdpa", quantization=quantization, quantization_group_size=32)
        top1[quantization] = [e.top[0][0] for out in llm.generate(prompts, params) for e in out.prompt_logprobs]

    def agree(quantization: str) -> float:
        return sum(a == b for a, b in zip(top1[None], top1[quantization])) / len(top1[None])

    # CPU figures (tests/integration/test_quantized_generation.py): INT8 0.89-0.92, INT4 g32 0.29-0.32.
    assert agree("int8") >= 0.85
    assert agree("int4") >= 0.24
