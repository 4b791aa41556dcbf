"""Prefix-aware routing across two prefill workers, checked against Redis and the workers' own cache hits."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from pdserve.cluster_index import PrefixIndexLookup, WorkerRegistry, connect
from pdserve.engine.types.hashing import hash_prompt_blocks
from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import random_prompts
from tests.e2e.conftest import REDIS_URL, cluster_config, generate, load
from tests.support.waiting import wait_until

PARAMS = generation_pb2.SamplingParams(max_tokens=4, temperature=0.0)


async def _index_counts(prefix: str, hashes: list[bytes]) -> dict[str, int]:
    redis = connect(REDIS_URL)
    try:
        live = {w.worker_id: w.epoch for w in await WorkerRegistry(redis, prefix).live_workers("prefill")}
        return await PrefixIndexLookup(redis, prefix).longest_prefix(hashes, live)
    finally:
        await redis.aclose()


async def _wait_for_count(prefix: str, hashes: list[bytes], worker: str, expected: int) -> dict[str, int]:
    """The index's counts once ``worker`` holds ``expected`` blocks of the prompt: publishing is asynchronous."""
    return await wait_until(lambda: _index_counts(prefix, hashes), f"{worker} to hold {expected} blocks",
                            until=lambda counts: counts.get(worker) == expected)


@pytest.mark.asyncio
async def test_shared_prefix_requests_land_on_the_worker_holding_it(llama_checkpoint: Path, start_cluster) -> None:
    config = cluster_config(llama_checkpoint, prefill_workers=2)
    cluster = start_cluster(config)
    shared = random_prompts([160], seed=60)[0]  # 10 full blocks
    suffixes = random_prompts([5, 12, 20, 7, 30], seed=61)
    model_id = (await load(cluster.prefill_addresses[0], "prefill")).model_id

    first = shared + suffixes[0]
    (*_, last) = await generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=first, sampling_params=PARAMS))
    assert last.usage.cached_prompt_tokens == 0
    hashes = hash_prompt_blocks(first, 16, model_id)
    # Exactly one worker holds the first prompt's 10 full blocks, and the index says so.
    counts = await wait_until(lambda: _index_counts(config.redis_prefix, hashes), "one worker to hold 10 blocks",
                              until=lambda counts: sorted(counts.values()) == [0, 10])
    assert sorted(counts.values()) == [0, 10]
    holder = max(counts, key=counts.__getitem__)

    # Each later request shares the prefix: routed to the holder, served from its cache.
    for suffix in suffixes[1:]:
        prompt = shared + suffix
        (*_, last) = await generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=PARAMS))
        # The worker's own truth (cached tokens it skipped) equals what Redis predicted.
        assert last.usage.cached_prompt_tokens == 160
        # ...and once published, the index holds every full block of it there, none elsewhere.
        counts = await _wait_for_count(config.redis_prefix, hash_prompt_blocks(prompt, 16, model_id), holder, len(prompt) // 16)
        other = next(w for w in counts if w != holder)
        assert (counts[holder], counts[other]) == (len(prompt) // 16, 0)


@pytest.mark.asyncio
async def test_restarted_worker_stale_index_entries_are_not_used(llama_checkpoint: Path, start_cluster) -> None:
    config = cluster_config(llama_checkpoint, prefill_workers=1)
    cluster = start_cluster(config)
    prompt = random_prompts([100], seed=62)[0]  # 6 full blocks
    await generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=PARAMS))
    report = await load(cluster.prefill_addresses[0], "prefill")
    hashes = hash_prompt_blocks(prompt, 16, report.model_id)
    counts = await _wait_for_count(config.redis_prefix, hashes, "prefill-0", 6)
    assert counts == {"prefill-0": 6}

    # A crash leaves its entries in Redis; the restarted process has a new epoch and an empty cache.
    cluster.kill("prefill-0")
    cluster.restart("prefill-0")
    restarted = await load(cluster.prefill_addresses[0], "prefill")
    assert restarted.epoch != report.epoch
    assert await _index_counts(config.redis_prefix, hashes) == {"prefill-0": 0}
    # The gateway notices the restart within a few seconds; the request is computed, not counted as cached.
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=PARAMS)

    async def served() -> generation_pb2.GenerateResponse | None:
        try:
            (*_, last) = await generate(cluster.endpoint, request)
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            return None
        return last

    last = await wait_until(served, "a request served by the restarted worker")
    assert last.usage.cached_prompt_tokens == 0
    assert await _wait_for_count(config.redis_prefix, hashes, "prefill-0", 6) == {"prefill-0": 6}
