"""The model families' mechanisms through real processes: a sliding-window family, a mixture-of-experts family
and a latent-attention family, each served disaggregated (1 prefill, 1 decode worker), with prefix hits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import Oracle, random_prompts
from tests.e2e.conftest import cluster_config, generate, load

MAX_TOKENS = 20


def _tokens(responses: list) -> list[int]:
    return [t for r in responses for t in r.token_ids]


@pytest.mark.asyncio
async def test_sliding_window_family_disaggregated_with_prefix_hits_equals_transformers(
    mistral_checkpoint: Path, start_cluster
) -> None:
    # The tiny Mistral slides a 48-token window: every prompt but the first outgrows it, in prefill
    # (on the prefill worker) and in decode (on the decode worker, over the handed-off KV).
    cluster = start_cluster(cluster_config(mistral_checkpoint))
    prompts = random_prompts([20, 47, 49, 90, 130], seed=70)
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = await asyncio.gather(
        *(generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params))
          for p in prompts)
    )
    oracle = Oracle(mistral_checkpoint)
    for prompt, responses in zip(prompts, results):
        assert _tokens(responses) == oracle.generate(prompt, MAX_TOKENS), f"{len(prompt)}-token prompt"
    # The 130-token prompt again, extended: its 8 full blocks are a prefix hit on the prefill worker.
    extended = prompts[4] + random_prompts([15], seed=71)[0]
    responses = await generate(
        cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=extended, sampling_params=params)
    )
    assert responses[-1].usage.cached_prompt_tokens == 128
    assert _tokens(responses) == oracle.generate(extended, MAX_TOKENS)
    report = await load(cluster.decode_addresses[0], "decode")
    assert (report.num_running, report.num_free_blocks) == (0, 256)


@pytest.mark.asyncio
async def test_mixture_of_experts_family_disaggregated_with_prefix_hits_equals_transformers(
    qwen3_moe_checkpoint: Path, start_cluster
) -> None:
    # The tiny Qwen3-MoE routes each token to 3 of 8 experts in layers 0 and 2 (layer 1 dense), on the
    # prefill worker for the prompt and on the decode worker for the rest.
    cluster = start_cluster(cluster_config(qwen3_moe_checkpoint))
    prompts = random_prompts([3, 20, 49, 90], seed=72)
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = await asyncio.gather(
        *(generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params))
          for p in prompts)
    )
    oracle = Oracle(qwen3_moe_checkpoint)
    for prompt, responses in zip(prompts, results):
        assert _tokens(responses) == oracle.generate(prompt, MAX_TOKENS), f"{len(prompt)}-token prompt"
    extended = prompts[3] + random_prompts([10], seed=73)[0]
    responses = await generate(
        cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=extended, sampling_params=params)
    )
    assert responses[-1].usage.cached_prompt_tokens == 80  # the 90-token prompt's 5 full blocks
    assert _tokens(responses) == oracle.generate(extended, MAX_TOKENS)
    report = await load(cluster.decode_addresses[0], "decode")
    assert (report.num_running, report.num_free_blocks) == (0, 256)


@pytest.mark.asyncio
async def test_latent_attention_family_disaggregated_with_prefix_hits_equals_transformers(
    deepseek_v3_checkpoint: Path, start_cluster
) -> None:
    # The tiny DeepSeek-V3 caches one 40-feature latent row per token and layer: the prefill worker hands
    # those rows over, and the decode worker attends them in the absorbed form.
    cluster = start_cluster(cluster_config(deepseek_v3_checkpoint))
    prompts = random_prompts([4, 21, 48, 95], seed=74)
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = await asyncio.gather(
        *(generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params))
          for p in prompts)
    )
    oracle = Oracle(deepseek_v3_checkpoint)
    for prompt, responses in zip(prompts, results):
        assert _tokens(responses) == oracle.generate(prompt, MAX_TOKENS), f"{len(prompt)}-token prompt"
    extended = prompts[3] + random_prompts([12], seed=75)[0]
    responses = await generate(
        cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=extended, sampling_params=params)
    )
    assert responses[-1].usage.cached_prompt_tokens == 80  # the 95-token prompt's 5 full blocks
    assert _tokens(responses) == oracle.generate(extended, MAX_TOKENS)
    report = await load(cluster.decode_addresses[0], "decode")
    assert (report.num_running, report.num_free_blocks) == (0, 256)
