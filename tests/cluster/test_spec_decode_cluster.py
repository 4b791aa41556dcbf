"""Decode and colocated workers speculate: greedy output through the gateway equals transformers', and the
workers export pdserve_spec_decode_* counters equal to their engines' own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.engine.types.speculative import SpeculativeConfig
from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import Oracle, StartInProcessCluster, random_prompts
from tests.observability.test_metrics import _scrape, _value
from tests.support.cluster import ClusterOptions
from tests.support.waiting import wait_until

MAX_TOKENS = 24


async def _generate(stub, prompt: list[int], use_speculation: bool = True) -> tuple[list[int], generation_pb2.Usage]:  # noqa: ANN001
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, use_speculation=use_speculation)
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)
    responses = [response async for response in stub.Generate(request, timeout=60)]
    return [t for response in responses for t in response.token_ids], responses[-1].usage


@pytest.mark.asyncio
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("colocated", [False, True])
async def test_speculating_workers_equal_transformers_and_count_it(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster, method: str, colocated: bool
) -> None:
    if method == "ngram":
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=8)
    else:
        # The target as its own draft: its KV for the prompt is recomputed on the decode worker.
        spec = SpeculativeConfig(
            method="draft_model", model=str(llama_checkpoint), num_speculative_tokens=3, disable_by_batch_size=8
        )
    roles = {"prefill_workers": 0, "decode_workers": 0, "colocated_workers": 1} if colocated else {}
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(num_kv_blocks=128, metrics=True, speculative_config=spec, **roles)
    )
    prompts = [p + p for p in random_prompts([4, 9, 20], seed=61)]
    # The last request asks not to be speculated on.
    results = await asyncio.gather(*(_generate(cluster.stub, p, i < 2) for i, p in enumerate(prompts)))
    oracle = Oracle(llama_checkpoint)
    assert [tokens for tokens, _ in results] == [oracle.generate(p, MAX_TOKENS) for p in prompts]
    usages = [usage for _, usage in results]
    assert usages[2].spec_decode_drafts == usages[2].spec_decode_draft_tokens == 0
    worker = cluster.colocated[0] if colocated else cluster.decode
    await wait_until(lambda: worker.runtime.async_engine.latest_stats.num_running == 0, "decodes finished")
    stats = worker.runtime.async_engine.latest_stats
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    if method == "draft_model":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    # Each request's usage carries its own counts; together they are the worker's.
    assert sum(u.spec_decode_drafts for u in usages) == stats.spec_num_drafts
    assert sum(u.spec_decode_draft_tokens for u in usages) == stats.spec_num_draft_tokens
    assert sum(u.spec_decode_accepted_tokens for u in usages) == stats.spec_num_accepted_tokens
    scraped = await _scrape(worker.metrics_endpoint.port)
    assert _value(scraped, "pdserve_spec_decode_num_drafts_total") == stats.spec_num_drafts
    assert _value(scraped, "pdserve_spec_decode_num_draft_tokens_total") == stats.spec_num_draft_tokens
    assert _value(scraped, "pdserve_spec_decode_num_accepted_tokens_total") == stats.spec_num_accepted_tokens
