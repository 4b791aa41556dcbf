"""The shared test helpers do what tests rely on: polls return or fail loudly, clusters start what they are asked to."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import grpc
import pytest

from pdserve.cluster_index import connect
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.server import ServerConfig
from tests.conftest import Oracle, StartInProcessCluster, random_prompts
from tests.support.cluster import REDIS_URL, ClusterOptions, InProcessCluster
from tests.support.waiting import wait_until, wait_until_sync


@pytest.mark.asyncio
async def test_wait_until_returns_the_first_value_that_satisfies_the_condition() -> None:
    values = iter([0, 0, 3, 4])
    assert await wait_until(lambda: next(values), "a truthy value", interval_s=0) == 3

    async def probe() -> list[int]:
        return [1, 2]

    assert await wait_until(probe, "two items", until=lambda items: len(items) == 2) == [1, 2]


@pytest.mark.asyncio
async def test_wait_until_raises_naming_what_it_waited_for_and_the_last_value() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"^timed out after 0.2 s waiting for the answer; last value: 41$"):
        await wait_until(lambda: 41, "the answer", 0.2, until=lambda value: value == 42)
    assert 0.2 <= time.monotonic() - started < 5.0


def test_wait_until_sync_polls_and_raises_the_same_way() -> None:
    values = iter([False, False, True])
    assert wait_until_sync(lambda: next(values), "True", interval_s=0) is True
    with pytest.raises(AssertionError, match=r"^timed out after 0.1 s waiting for never; last value: None$"):
        wait_until_sync(lambda: None, "never", 0.1)


@pytest.mark.asyncio
async def test_cluster_runs_the_workers_it_is_asked_for_and_deletes_its_redis_keys(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    options = ClusterOptions(num_kv_blocks=32, prefill_workers=2, decode_workers=2, redis=True, kv_transport="shm")
    cluster = await start_inprocess_cluster(llama_checkpoint, options)
    reports = await cluster.loads()
    assert [(r.role, r.worker_id, r.num_total_blocks) for r in reports] == [
        ("prefill", "p0", 32), ("prefill", "p1", 32), ("decode", "d0", 32), ("decode", "d1", 32)
    ]
    assert cluster.gateway is not None and len(cluster.gateway.pool.workers) == 4
    prompt = random_prompts([40], seed=30)[0]
    params = generation_pb2.SamplingParams(max_tokens=8, temperature=0.0)
    responses = await cluster.generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params))
    assert [t for r in responses for t in r.token_ids] == Oracle(llama_checkpoint).generate(prompt, 8)
    assert [r.num_free_blocks for r in await cluster.wait_idle()] == [32] * 4

    assert cluster.redis_prefix is not None
    redis = connect(REDIS_URL)
    try:
        assert await redis.exists(f"{cluster.redis_prefix}:workers") == 1
        await cluster.stop()
        assert [key async for key in redis.scan_iter(match=f"{cluster.redis_prefix}:*")] == []
    finally:
        await redis.aclose()


@pytest.mark.asyncio
async def test_a_colocated_worker_serves_both_roles_behind_the_gateway(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    options = ClusterOptions(num_kv_blocks=32, prefill_workers=0, decode_workers=0, colocated_workers=1)
    cluster = await start_inprocess_cluster(llama_checkpoint, options)
    assert [(r.role, r.worker_id) for r in await cluster.loads()] == [("colocated", "c0")]
    prompt = random_prompts([40], seed=31)[0]
    params = generation_pb2.SamplingParams(max_tokens=8, temperature=0.0)
    responses = await cluster.generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params))
    assert [t for r in responses for t in r.token_ids] == Oracle(llama_checkpoint).generate(prompt, 8)
    # Its 2 full prompt blocks came from its own prefix cache; only the partial third one moved.
    assert cluster.colocated[0].decode.kv_transfers == 1


@pytest.mark.asyncio
async def test_a_cluster_that_fails_to_start_stops_the_servers_it_started(llama_checkpoint: Path) -> None:
    with socket.socket() as busy:  # the gateway's port is taken: the workers start, the gateway cannot
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        options = ClusterOptions(num_kv_blocks=16, gateway_server=ServerConfig(port=busy.getsockname()[1]))
        cluster = InProcessCluster(llama_checkpoint, options)
        with pytest.raises(OSError, match="the port is in use"):
            async with cluster:
                pass
    assert len(cluster.prefill_addresses) == len(cluster.decode_addresses) == 1
    for address in cluster.prefill_addresses + cluster.decode_addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await worker_pb2_grpc.PrefillWorkerStub(channel).Load(worker_pb2.LoadRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, address
