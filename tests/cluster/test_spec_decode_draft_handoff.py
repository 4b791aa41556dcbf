"""The draft's prompt KV built on the prefill worker and handed over with the target's, over every CPU
transport: greedy output through the gateway equals transformers', the decode worker fetches the draft
section (and its draft never runs over a prompt), a decode worker without that draft ignores it, and
every block is free on both sides afterwards."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.engine.types.speculative import SpeculativeConfig
from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import Oracle, StartInProcessCluster, random_prompts
from tests.support.cluster import ClusterOptions

MAX_TOKENS = 16


async def _generate(stub, prompt: list[int]) -> list[int]:  # noqa: ANN001
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)
    return [t async for response in stub.Generate(request, timeout=60) for t in response.token_ids]


def _draft(path: Path) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=3, disable_by_batch_size=8)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["grpc", "shm", "torch_dist"])
async def test_draft_kv_handed_over_equals_transformers_over_each_transport(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster, transport: str
) -> None:
    spec = _draft(llama_checkpoint)  # the target as its own draft: every proposal is accepted
    cluster = await start_inprocess_cluster(
        llama_checkpoint,
        ClusterOptions(num_kv_blocks=128, speculative_config=spec, prefill_speculative_config=spec,
                       kv_transport=transport),
    )
    decode = cluster.decode
    prompt_starts: list[int] = []
    forward = decode.runtime.engine.draft._forward

    def logged(chunks, starts, tables):  # type: ignore[no-untyped-def]
        prompt_starts.extend(starts)
        return forward(chunks, starts, tables)

    decode.runtime.engine.draft._forward = logged
    prompts = random_prompts([5, 16, 37], seed=91)
    tokens = [await _generate(cluster.stub, p) for p in prompts]  # one at a time: each its own handoff
    oracle = Oracle(llama_checkpoint)
    assert tokens == [oracle.generate(p, MAX_TOKENS) for p in prompts]
    # Two transfers per request (the target's blocks and the draft section), and the draft section's bytes:
    # the same layout here (the target is its own draft), every block of the prompt.
    layout = decode.runtime.engine.kv_layout
    blocks = sum(-(-len(p) // layout.block_size) for p in prompts)
    assert decode.servicer.kv_transfers == 2 * len(prompts)
    assert decode.servicer.kv_bytes_received == 2 * blocks * layout.bytes_per_block
    assert prompt_starts and 0 not in prompt_starts
    stats = decode.runtime.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    await cluster.wait_idle()


@pytest.mark.asyncio
async def test_a_decode_worker_without_a_draft_ignores_the_draft_section(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(num_kv_blocks=128, prefill_speculative_config=_draft(llama_checkpoint))
    )
    prompts = random_prompts([9, 20], seed=92)
    tokens = await asyncio.gather(*(_generate(cluster.stub, p) for p in prompts))
    oracle = Oracle(llama_checkpoint)
    assert list(tokens) == [oracle.generate(p, MAX_TOKENS) for p in prompts]
    assert cluster.decode.servicer.kv_transfers == len(prompts)  # the target's blocks only
    await cluster.wait_idle()
