"""Leases on a prefill worker's held KV: pinned until ReleaseKV or expiry, then every block is free again."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from pdserve.prefill_service.server import PrefillServer
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from tests.conftest import StartInProcessCluster, random_prompts
from tests.support.cluster import NUM_KV_BLOCKS, ClusterOptions
from tests.support.waiting import wait_until

NUM_BLOCKS = 64
PROMPT = random_prompts([40], seed=80)[0]  # 2 full blocks and a partial one: 3 blocks held
BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4  # layers x (k, v) x block x kv heads x head dim x float32
# ignore_eos: the first token can never end the request, so a handoff always comes back.
PARAMS = generation_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


async def _prefill_worker(
    start_inprocess_cluster: StartInProcessCluster, checkpoint: Path, lease_s: float
) -> tuple[PrefillServer, worker_pb2_grpc.PrefillWorkerStub]:
    """A prefill worker on its own: no decode worker will ever claim its handoffs."""
    options = ClusterOptions(num_kv_blocks=NUM_BLOCKS, decode_workers=0, gateway=False, kv_handoff_timeout_s=lease_s)
    cluster = await start_inprocess_cluster(checkpoint, options)
    return cluster.prefill, cluster.worker_stubs[0]  # type: ignore[return-value]


@pytest_asyncio.fixture
async def short_lease(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> AsyncIterator[tuple[PrefillServer, worker_pb2_grpc.PrefillWorkerStub]]:
    yield await _prefill_worker(start_inprocess_cluster, llama_checkpoint, lease_s=0.5)


@pytest_asyncio.fixture
async def long_lease(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> AsyncIterator[tuple[PrefillServer, worker_pb2_grpc.PrefillWorkerStub]]:
    yield await _prefill_worker(start_inprocess_cluster, llama_checkpoint, lease_s=30.0)


async def _wait_free_blocks(stub: worker_pb2_grpc.PrefillWorkerStub, expected: int) -> int:
    """The worker's free block count once it equals ``expected``.

    Releases run on the engine thread after the RPC that caused them returns, and the engine
    publishes its stats just after delivering a step's outputs, hence the wait either way.
    """

    async def free_blocks() -> int:
        return (await stub.Load(worker_pb2.LoadRequest(), timeout=5)).num_free_blocks

    return await wait_until(free_blocks, f"{expected} free blocks", until=lambda free: free == expected)


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
    assert await _wait_free_blocks(stub, NUM_BLOCKS - 3) == NUM_BLOCKS - 3
    # ...and once it runs out (0.5 s), every block is free and the KV is gone.
    assert await _wait_free_blocks(stub, NUM_BLOCKS) == NUM_BLOCKS
    assert server.servicer.leases.num_expired == 1
    assert len(server.servicer.leases) == 0
    assert server.runtime.engine.leases.request_ids == []
    assert await _fetch_code(stub, "never-decoded") == (grpc.StatusCode.NOT_FOUND, 0)


@pytest.mark.asyncio
async def test_release_kv_frees_held_blocks_before_the_lease_expires(long_lease) -> None:
    server, stub = long_lease
    await _prefill(stub, "released-early")
    assert await _wait_free_blocks(stub, NUM_BLOCKS - 3) == NUM_BLOCKS - 3
    # While leased, the blocks can be fetched (a decode worker's first step).
    assert await _fetch_code(stub, "released-early") == (grpc.StatusCode.OK, 3 * BLOCK_BYTES)

    await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="released-early"), timeout=5)
    # Freed by the release, not by the 30 s lease: nothing expired.
    assert await _wait_free_blocks(stub, NUM_BLOCKS) == NUM_BLOCKS
    assert server.servicer.leases.num_expired == 0
    assert len(server.servicer.leases) == 0
    assert server.runtime.engine.leases.request_ids == []
    assert await _fetch_code(stub, "released-early") == (grpc.StatusCode.NOT_FOUND, 0)
    # A second release of the same id is harmless.
    await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="released-early"), timeout=5)
    assert (await stub.Load(worker_pb2.LoadRequest(), timeout=5)).num_free_blocks == NUM_BLOCKS



@pytest.mark.asyncio
async def test_prefill_that_times_out_while_the_engine_is_busy_holds_no_blocks(long_lease) -> None:
    server, stub = long_lease
    # The engine thread is busy (as in a long prefill step) when the request arrives, and stays
    # busy until the client has given up.
    busy = threading.Event()
    server.runtime.async_engine.submit(lambda engine: busy.wait(timeout=60))
    try:
        request = worker_pb2.PrefillRequest(request_id="gave-up", prompt_token_ids=PROMPT, sampling_params=PARAMS)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Prefill(request, timeout=0.3)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        busy.set()
    # Let the engine catch up: the queued add has run, and so has any step it led to.
    engine = server.runtime.async_engine
    await wait_until(lambda: engine.call(lambda engine: not engine.has_unfinished_requests()),
                     "the engine to finish the abandoned request")
    # Nobody will ever claim or release this request's KV: none of it may stay held.
    assert await _wait_free_blocks(stub, NUM_BLOCKS) == NUM_BLOCKS
    assert server.runtime.engine.leases.request_ids == []
    assert len(server.servicer.leases) == 0


class _AnswerLostInFlight:
    """A gateway's stub for a prefill worker whose answer is still on its way when the client gives up.

    The worker has run the prefill and granted the lease; the gateway never reads the answer.
    Every other RPC (Load, ReleaseKV) goes to the real stub.
    """

    def __init__(self, stub: worker_pb2_grpc.PrefillWorkerStub, on_answered) -> None:  # noqa: ANN001
        self._stub = stub
        self._on_answered = on_answered

    def Prefill(self, request: worker_pb2.PrefillRequest, timeout: float | None = None):  # noqa: N802, ANN201
        return self._prefill(request, timeout)

    async def _prefill(self, request: worker_pb2.PrefillRequest, timeout: float | None) -> worker_pb2.PrefillResponse:
        response = await self._stub.Prefill(request, timeout=timeout)
        self._on_answered()
        await asyncio.Event().wait()  # in flight until the gateway's handler is cancelled
        return response

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)


@pytest.mark.asyncio
async def test_client_cancel_while_the_prefill_answer_is_in_flight_still_releases_the_lease(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # The worker grants a lease that no decode worker will claim, and no worker hears of the cancel (the
    # gateway manages no KV): the handoff deadline frees it, here a short one.
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(kv_handoff_timeout_s=2.0))
    assert cluster.gateway is not None and cluster.stub is not None
    call = cluster.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, sampling_params=PARAMS), timeout=30)
    (handle,) = [w for w in cluster.gateway.pool.workers.values() if w.role == "prefill"]
    handle.stub = _AnswerLostInFlight(handle.stub, on_answered=call.cancel)  # type: ignore[assignment]
    assert await call.code() == grpc.StatusCode.CANCELLED
    reports = await cluster.wait_idle()
    assert [r.num_free_blocks for r in reports] == [NUM_KV_BLOCKS, NUM_KV_BLOCKS]
    assert len(cluster.prefill.servicer.leases) == 0
