"""Every ISA variant of the CPU kernels this CPU runs gives the same greedy tokens through ``LLM.generate``.

float32 against transformers' generate (the paged-attention kernel decodes); bf16 with INT8 and INT4
weights, whose integer sums are the same bits in every variant, against the portable variant's tokens.
The variant is the one ``PDSERVE_CPU_ISA`` names, as a user forcing a lower one would run it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.native import ISA_ENV, supported_variants
from tests.conftest import Oracle, random_prompts
from tests.support.cpu_paths import variant_params

PROMPTS = random_prompts([5, 17, 40, 95], seed=61)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def _tokens(checkpoint: Path, **options: object) -> list[list[int]]:
    llm = LLM(model=str(checkpoint), num_kv_blocks=64, **options)
    assert llm.engine.runner.backend.name == "cpu_paged"
    return [output.token_ids for output in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("variant", variant_params())
def test_float32_tokens_equal_transformers_in_every_variant(
    variant: str, llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ISA_ENV, variant)
    oracle = Oracle(llama_checkpoint)
    assert _tokens(llama_checkpoint, dtype="float32") == [oracle.generate(prompt, 16) for prompt in PROMPTS]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_bf16_tokens_are_the_portable_variants_in_every_variant(
    quantization: str, llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"dtype": "bfloat16", "quantization": quantization, "quantization_group_size": 32}
    monkeypatch.setenv(ISA_ENV, "portable")
    portable = _tokens(llama_checkpoint, **options)
    for variant in supported_variants()[1:]:
        monkeypatch.setenv(ISA_ENV, variant)
        assert _tokens(llama_checkpoint, **options) == portable, variant
