"""What an orchestrator's probes see: readiness drops while a server drains, liveness only when it cannot serve.

The plaintext ``--health-port`` is what Kubernetes' gRPC probes call (they cannot speak TLS).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.server import LIVENESS_SERVICE, Server, ServerConfig
from tests.conftest import StartInProcessCluster
from tests.support.cluster import ClusterOptions
from tests.support.waiting import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status


def _held_call_server(release: asyncio.Event, started: asyncio.Event) -> Server:
    """A server with one unary method that answers only once ``release`` is set."""
    server = Server(ServerConfig(port=0, health_port=0, grace_s=30.0), ["test.Held"])

    async def held(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        started.set()
        await release.wait()
        return b"done"

    handler = grpc.unary_unary_rpc_method_handler(held)
    server.grpc_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Held", {"Call": handler}),))
    return server


@pytest.mark.asyncio
async def test_while_draining_readiness_is_not_serving_and_liveness_stays_serving() -> None:
    release, started = asyncio.Event(), asyncio.Event()
    server = _held_call_server(release, started)
    port = await server.start()
    stopping = None
    try:
        assert server.health_port not in (0, port)
        for service in ("", "test.Held", LIVENESS_SERVICE):
            assert await _status(server.health_port, service) == SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/test.Held/Call")(b"", timeout=30)
            await started.wait()
            stopping = asyncio.create_task(server.stop())
            # The drain waits for the held call; meanwhile the health port answers.
            await wait_until(lambda: _status(server.health_port, ""), "readiness NOT_SERVING",
                             until=lambda status: status == NOT_SERVING)
            assert await _status(server.health_port, "test.Held") == NOT_SERVING
            assert await _status(server.health_port, LIVENESS_SERVICE) == SERVING
            assert not stopping.done()
            release.set()
            assert await call == b"done"
        await asyncio.wait_for(stopping, 10)
        # Drained and stopped: nothing listens on the health port any more.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _status(server.health_port, "")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        release.set()
        if stopping is None:
            await server.stop()
        else:
            await asyncio.gather(stopping, return_exceptions=True)


@pytest.mark.asyncio
async def test_a_stop_with_a_shorter_grace_cuts_the_held_call_short() -> None:
    # What a worker whose engine died does (service_common.worker.DEAD_ENGINE_GRACE_S): its configured
    # 30 s drain would hold the process up while nothing it runs can finish.
    release, started = asyncio.Event(), asyncio.Event()
    server = _held_call_server(release, started)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/test.Held/Call")(b"", timeout=30)
            await started.wait()
            await asyncio.wait_for(server.stop(grace_s=0.2), 10)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls")
    finally:
        release.set()
        await server.stop()


@pytest.mark.asyncio
async def test_a_taken_health_port_fails_the_start_naming_the_flag() -> None:
    first = Server(ServerConfig(port=0, health_port=0), [])
    await first.start()
    try:
        second = Server(ServerConfig(port=0, health_port=first.health_port), [])
        with pytest.raises(OSError, match="--health-port"):
            await second.start()
        await second.stop()
    finally:
        await first.stop()


@pytest.mark.asyncio
async def test_a_dead_engine_turns_liveness_not_serving_on_the_health_port(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    options = ClusterOptions(num_kv_blocks=32, decode_workers=0, gateway=False,
                             worker_server=ServerConfig(health_port=0))
    cluster = await start_inprocess_cluster(llama_checkpoint, options)
    health_port = cluster.prefill.server.health_port
    assert await _status(health_port, LIVENESS_SERVICE) == SERVING

    def broken_step() -> list:
        raise RuntimeError("simulated engine failure")

    cluster.prefill.runtime.engine.step = broken_step  # type: ignore[method-assign]
    request = worker_pb2.PrefillRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3], sampling_params=generation_pb2.SamplingParams(max_tokens=4)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await cluster.worker_stubs[0].Prefill(request, timeout=20)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # The watchdog looks every 0.5 s; then the process would exit to be restarted.
    await wait_until(lambda: _status(health_port, LIVENESS_SERVICE), "liveness NOT_SERVING",
                     until=lambda status: status == NOT_SERVING)
    assert await _status(health_port, "") == NOT_SERVING
    assert cluster.prefill.engine_dead.is_set()
