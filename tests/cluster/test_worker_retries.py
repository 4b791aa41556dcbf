"""The gateway counts every request it moves to another worker after its worker failed before sending anything."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.gateway.workers import WorkerHandle
from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import Oracle, StartInProcessCluster, random_prompts
from tests.support.cluster import ClusterOptions, InProcessCluster

MAX_TOKENS = 6


def _retries(cluster: InProcessCluster) -> dict[str, float]:
    assert cluster.gateway is not None
    counts = {}
    for metric in cluster.gateway.servicer.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "pdserve_gateway_worker_retries_total":
                counts[sample.labels["role"]] = sample.value
    return counts


@pytest.mark.asyncio
async def test_a_decode_worker_failing_before_its_first_token_is_retried_elsewhere_and_counted(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(decode_workers=2, gateway_args={"kv_push": False})
    )
    assert cluster.gateway is not None
    assert _retries(cluster) == {"prefill": 0.0, "decode": 0.0}
    router = cluster.gateway.servicer.router
    handles = {handle.address: handle for handle in router.pool.healthy("decode")}
    victim, survivor = (handles[address] for address in cluster.decode_addresses)
    await cluster.decodes[0].server.grpc_server.stop(0)
    # The first choice is the stopped worker, whatever the load polls have seen of it since.
    choices = iter([victim, survivor])

    def choose_decode(*args: object, **kwargs: object) -> WorkerHandle:
        return next(choices)

    router.choose_decode = choose_decode
    prompt = random_prompts([40], seed=141)[0]
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling_params=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    responses = await asyncio.wait_for(cluster.generate(request), 60)
    assert [t for r in responses for t in r.token_ids] == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    assert _retries(cluster) == {"prefill": 0.0, "decode": 1.0}
    assert victim.healthy is False
    survivor_servicer = cluster.decodes[1].servicer
    assert (survivor_servicer.kv_pushes, survivor_servicer.kv_transfers) == (0, 1)
