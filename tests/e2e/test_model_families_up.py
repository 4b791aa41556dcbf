"""The model families' mechanisms through real processes: a sliding-window family, a mixture-of-experts family
and a latent-attention family, each served disaggregated (1 prefill, 1 decode worker), with prefix hits."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import Oracle, random_prompts
from tests.e2e.conftest import cluster_config, generate, load

MAX_TOKENS = 20


@dataclass(frozen=True)
class Case:
    family: str
    prompt_lens: list[int]
    seed: int
    # The last prompt again, extended by this many tokens: its full blocks are a prefix hit on the prefill worker.
    extension: int
    cached_tokens: int


CASES = [
    # The tiny Mistral slides a 48-token window: every prompt but the first outgrows it, in prefill (on the
    # prefill worker) and in decode (on the decode worker, over the handed-off KV).
    Case("mistral", [20, 47, 49, 90, 130], seed=70, extension=15, cached_tokens=128),
    # The tiny Qwen3-MoE routes each token to 3 of 8 experts in layers 0 and 2 (layer 1 dense), on the prefill
    # worker for the prompt and on the decode worker for the rest.
    Case("qwen3_moe", [3, 20, 49, 90], seed=72, extension=10, cached_tokens=80),
    # The tiny DeepSeek-V3 caches one 40-feature latent row per token and layer: the prefill worker hands those
    # rows over, and the decode worker attends them in the absorbed form.
    Case("deepseek_v3", [4, 21, 48, 95], seed=74, extension=12, cached_tokens=80),
]


def _tokens(responses: list) -> list[int]:
    return [t for r in responses for t in r.token_ids]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=[case.family for case in CASES])
async def test_family_disaggregated_with_prefix_hits_equals_transformers(
    case: Case, request: pytest.FixtureRequest, start_cluster
) -> None:
    checkpoint = request.getfixturevalue(f"{case.family}_checkpoint")
    cluster = start_cluster(cluster_config(checkpoint))
    prompts = random_prompts(case.prompt_lens, seed=case.seed)
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = await asyncio.gather(
        *(generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params))
          for p in prompts)
    )
    oracle = Oracle(checkpoint)
    for prompt, responses in zip(prompts, results):
        assert _tokens(responses) == oracle.generate(prompt, MAX_TOKENS), f"{len(prompt)}-token prompt"
    extended = prompts[-1] + random_prompts([case.extension], seed=case.seed + 1)[0]
    responses = await generate(
        cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=extended, sampling_params=params)
    )
    assert responses[-1].usage.cached_prompt_tokens == case.cached_tokens
    assert _tokens(responses) == oracle.generate(extended, MAX_TOKENS)
    report = await load(cluster.decode_addresses[0], "decode")
    assert (report.num_running, report.num_free_blocks) == (0, 256)
