"""Leases on a prefill worker's held KV: pinned until ReleaseKV or expiry, then every block is free again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from prefill_service.server import PrefillServer
from protos.pdserve.v1 import generation_pb2
from protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from service_common.server import ServerConfig, channel_options
from service_common.worker import WorkerConfig
from tests.conftest import random_prompts

NUM_BLOCKS = 64
PROMPT = random_prompts([40], seed=80)[0]  # 2 full blocks and a partial one: 3 blocks held
BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4  # layers x (k, v) x block x kv heads x head dim x float32
# ignore_eos: the first token can never end the request, so a handoff always comes back.
PARAMS = generation_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


async def _start(checkpoint: Path, lease_s: float) -> tuple[PrefillServer, grpc.aio.Channel]:
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=str(checkpoint), dtype="float32"), cache=CacheConfig(num_kv_blocks=NUM_BLOCKS))
    )
    server = PrefillServer(engine, ServerConfig(), WorkerConfig("prefill", "p0"), lease_s=lease_s)
    port = await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())


@pytest_asyncio.fixture
async def short_lease(llama_checkpoint: Path) -> AsyncIterator[tuple[PrefillServer, worker_pb2_grpc.PrefillWorkerStub]]:
    server, channel = await _start(llama_checkpoint, lease_s=0.5)
    try:
        yield server, worker_pb2_grpc.PrefillWorkerStub(channel)
    finally:
        await channel.close()
        await server.stop()


@pytest_asyncio.fixture
async def long_lease(llama_checkpoint: Path) -> AsyncIterator[tuple[PrefillServer, worker_pb2_grpc.PrefillWorkerStub]]:
    server, channel = await _start(llama_checkpoint, lease_s=30.0)
    try:
        yield server, worker_pb2_grpc.PrefillWorkerStub(channel)
    finally:
        await channel.close()
        await server.stop()


async def _wait_free_blocks(stub: worker_pb2_grpc.PrefillWorkerStub, expected: int, timeout_s: float = 5.0) -> int:
    """The worker's free block count once it equals ``expected``, or the last one seen after ``timeout_s``.

    Releases run on the engine thread after the RPC that caused them returns, hence the wait.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        free = (await stub.Load(worker_pb2.LoadRequest(), timeout=5)).num_free_blocks
        if free == expected or loop.time() > deadline:
            return free
        await asyncio.sleep(0.02)


async def _fetch_code(stub: worker_pb2_grpc.PrefillWorkerStub, request_id: str) -> tuple[grpc.StatusCode, int]:
    """FetchKV's status and the number of bytes it streamed."""
    received = 0
    try:
        async for chunk in stub.FetchKV(worker_pb2.FetchKVRequest(request_id=request_id, first_block=0), timeout=5):
            received += len(chunk.data)
    except grpc.aio.AioRpcError as error:
        return error.code(), received
    return grpc.StatusCode.OK, received


async def _prefill(stub: worker_pb2_grpc.PrefillWorkerStub, request_id: str) -> worker_pb2.PrefillResponse:
    request = worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=PROMPT, sampling_params=PARAMS)
    response = await stub.Prefill(request, timeout=30)
    assert response.HasField("handoff")
    assert (response.handoff.num_tokens, len(response.handoff.block_hashes)) == (40, 2)
    return response


@pytest.mark.asyncio
async def test_unclaimed_handoff_pins_blocks_until_the_lease_expires_then_frees_them(short_lease) -> None:
    server, stub = short_lease
    await _prefill(stub, "never-decoded")
    # No decode worker ever comes: the 3 blocks stay pinned for the lease...
    pinned = (await stub.Load(worker_pb2.LoadRequest(), timeout=5)).num_free_blocks
    assert pinned == NUM_BLOCKS - 3
    # ...and once it runs out (0.5 s), every block is free and the KV is gone.
    assert await _wait_free_blocks(stub, NUM_BLOCKS) == NUM_BLOCKS
    assert server.servicer.leases.num_expired == 1
    assert len(server.servicer.leases) == 0
    assert server.runtime.engine.held_request_ids == []
    assert await _fetch_code(stub, "never-decoded") == (grpc.StatusCode.NOT_FOUND, 0)


@pytest.mark.asyncio
async def test_release_kv_frees_held_blocks_before_the_lease_expires(long_lease) -> None:
    server, stub = long_lease
    await _prefill(stub, "released-early")
    assert (await stub.Load(worker_pb2.LoadRequest(), timeout=5)).num_free_blocks == NUM_BLOCKS - 3
    # While leased, the blocks can be fetched (a decode worker's first step).
    assert await _fetch_code(stub, "released-early") == (grpc.StatusCode.OK, 3 * BLOCK_BYTES)

    await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="released-early"), timeout=5)
    # Freed by the release, not by the 30 s lease: nothing expired.
    assert await _wait_free_blocks(stub, NUM_BLOCKS) == NUM_BLOCKS
    assert server.servicer.leases.num_expired == 0
    assert len(server.servicer.leases) == 0
    assert server.runtime.engine.held_request_ids == []
    assert await _fetch_code(stub, "released-early") == (grpc.StatusCode.NOT_FOUND, 0)
    # A second release of the same id is harmless.
    await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="released-early"), timeout=5)
    assert (await stub.Load(worker_pb2.LoadRequest(), timeout=5)).num_free_blocks == NUM_BLOCKS
