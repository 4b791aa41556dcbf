"""A Redis outage under a live cluster: requests keep succeeding, and the index rebuilds itself once Redis returns."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from pdserve.cluster_index import PrefixIndexLookup, WorkerRegistry, connect
from pdserve.engine.types.hashing import hash_prompt_blocks
from pdserve.launcher import redis_answers
from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import random_prompts
from tests.e2e.conftest import cluster_config, generate, load
from tests.support.waiting import wait_until, wait_until_sync

MAX_TOKENS = 6
PARAMS = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Heartbeats every ttl / 3 = 3.3 s; the first one after Redis returns re-registers and resyncs.
RECOVERY_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_redis(port: int) -> subprocess.Popen[bytes]:
    """A private, empty, non-persistent Redis on loopback ``port``, answering when this returns."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_sync(lambda: process.poll() is not None or redis_answers(f"redis://127.0.0.1:{port}/0"),
                        f"redis-server to answer on port {port}")
    except AssertionError:
        process.kill()
        process.wait()
        raise
    if process.returncode is not None:
        raise RuntimeError(f"redis-server did not start on port {port} (exit status {process.returncode})")
    return process


async def _live_prefill(url: str, prefix: str) -> dict[str, int]:
    """Prefill worker id -> epoch, as the registry lists them."""
    redis = connect(url)
    try:
        return {w.worker_id: w.epoch for w in await WorkerRegistry(redis, prefix).live_workers("prefill")}
    finally:
        await redis.aclose()


async def _index_counts(url: str, prefix: str, hashes: list[bytes]) -> dict[str, int]:
    redis = connect(url)
    try:
        live = {w.worker_id: w.epoch for w in await WorkerRegistry(redis, prefix).live_workers("prefill")}
        return await PrefixIndexLookup(redis, prefix).longest_prefix(hashes, live)
    finally:
        await redis.aclose()


async def _wait_for_counts(url: str, prefix: str, hashes: list[bytes], expected: list[int]) -> dict[str, int]:
    """The index's counts once their sorted values equal ``expected``."""
    return await wait_until(lambda: _index_counts(url, prefix, hashes), f"index counts {expected}",
                            until=lambda counts: sorted(counts.values()) == expected)


async def _completion_tokens(endpoint: str, prompt: list[int]) -> int:
    responses = await generate(endpoint, generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=PARAMS))
    return sum(len(r.token_ids) for r in responses)


@pytest.mark.asyncio
async def test_requests_survive_a_redis_outage_and_workers_reregister_and_resync_when_it_returns(
    llama_checkpoint: Path, start_cluster
) -> None:
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis_processes = [_start_redis(port)]
    try:
        config = cluster_config(llama_checkpoint, redis_url=url, prefill_workers=2)
        cluster = start_cluster(config)
        prefix = config.redis_prefix
        shared = random_prompts([100], seed=90)[0]  # 6 full blocks
        during_outage = random_prompts([80, 33, 57, 120], seed=91)
        reports = [await load(address, "prefill") for address in cluster.prefill_addresses]
        epochs = {report.worker_id: report.epoch for report in reports}
        model_id = reports[0].model_id
        shared_hashes = hash_prompt_blocks(shared, 16, model_id)

        # Redis up: the request succeeds and exactly one worker is indexed as holding the prefix.
        assert await _completion_tokens(cluster.endpoint, shared) == MAX_TOKENS
        before = await _wait_for_counts(url, prefix, shared_hashes, [0, 6])
        assert sorted(before.values()) == [0, 6]
        holder = max(before, key=before.__getitem__)

        # Redis dies (SIGKILL: no goodbye): requests keep succeeding on load-only routing.
        redis_processes[0].kill()
        redis_processes[0].wait()
        for prompt in during_outage:
            assert await _completion_tokens(cluster.endpoint, prompt) == MAX_TOKENS

        # Redis returns on the same port, empty. Within a few heartbeats both workers are
        # registered again (same processes, same epochs) and have rewritten their cached blocks.
        redis_processes.append(_start_redis(port))
        live = await wait_until(lambda: _live_prefill(url, prefix), "both workers registered again",
                                RECOVERY_TIMEOUT_S, until=lambda live: live == epochs)
        assert live == epochs
        # Blocks published before the outage are back, on the worker that still caches them.
        assert await _wait_for_counts(url, prefix, shared_hashes, [0, 6]) == before
        # Blocks computed while Redis was down were never published; the resync publishes them.
        for prompt in during_outage:
            hashes = hash_prompt_blocks(prompt, 16, model_id)
            counts = await _wait_for_counts(url, prefix, hashes, [0, len(prompt) // 16])
            assert sorted(counts.values()) == [0, len(prompt) // 16], f"{len(prompt)}-token prompt"
        # And routing uses the rebuilt index again: the shared prefix is served from a cache.
        responses = await generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=shared, sampling_params=PARAMS))
        assert responses[-1].usage.cached_prompt_tokens == 96
    finally:
        for process in redis_processes:
            if process.poll() is None:
                process.kill()
            process.wait()
