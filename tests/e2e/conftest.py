"""Real processes on loopback: a local cluster per test, stopped by PID even when the test fails."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.launcher import ClusterConfig, LocalCluster
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.server import channel_options

REDIS_URL = "redis://127.0.0.1:6379/0"


def cluster_config(checkpoint: Path, **overrides: object) -> ClusterConfig:
    values: dict[str, object] = {
        "model": str(checkpoint),
        "dtype": "float32",
        "port": 0,
        "redis_url": REDIS_URL,
        "redis_prefix": f"pdserve-test-{uuid.uuid4().hex}",
        "engine_args": ("--num-kv-blocks", "256"),
        "start_timeout_s": 180.0,
        # The handoff path these tests are about (`pdserve up` defaults to auto, which may prefill locally).
        "disaggregation": "always",
    }
    values.update(overrides)
    return ClusterConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
def start_cluster() -> Iterator:
    clusters: list[LocalCluster] = []

    def start(config: ClusterConfig) -> LocalCluster:
        cluster = LocalCluster(config)
        clusters.append(cluster)
        cluster.start()
        return cluster

    try:
        yield start
    finally:
        for cluster in clusters:
            cluster.stop()
            _delete_keys(cluster.config.redis_prefix)


def _delete_keys(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


async def generate(endpoint: str, request: generation_pb2.GenerateRequest, timeout: float = 60) -> list:
    async with grpc.aio.insecure_channel(endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [r async for r in stub.Generate(request, timeout=timeout)]


async def load(address: str, role: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub_class = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        return await stub_class(channel).Load(worker_pb2.LoadRequest(), timeout=5)


async def stream_outcome(call: grpc.aio.UnaryStreamCall) -> grpc.StatusCode:
    """How a streaming call ended: OK, or its error's code. read() throughout: grpc.aio forbids mixing
    it with iteration on one call."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK
