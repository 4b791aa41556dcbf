"""Gateway, prefill and decode servers in one process on ephemeral loopback ports, with real Redis."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from decode_service.server import DecodeServer
from gateway.server import GatewayServer
from prefill_service.server import PrefillServer
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from service_common.server import ServerConfig, channel_options
from service_common.worker import WorkerConfig
from tests.conftest import Oracle, random_prompts

REDIS_URL = "redis://127.0.0.1:6379/0"
MAX_TOKENS = 24


def _engine(path: Path, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32"), cache=CacheConfig(num_kv_blocks=num_blocks)))


async def _collect(stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest) -> tuple[list[int], list]:
    tokens: list[int] = []
    responses = []
    async for response in stub.Generate(request, timeout=60):
        tokens.extend(response.token_ids)
        responses.append(response)
    return tokens, responses


@pytest.mark.asyncio
async def test_cluster_in_process_equals_transformers(llama_checkpoint: Path) -> None:
    prefix = f"pdserve-test-{uuid.uuid4().hex}"
    prefill = PrefillServer(_engine(llama_checkpoint), ServerConfig(), WorkerConfig("prefill", "p0", REDIS_URL, prefix))
    decode = DecodeServer(_engine(llama_checkpoint), ServerConfig(), WorkerConfig("decode", "d0", REDIS_URL, prefix))
    servers: list = []
    try:
        p_port = await prefill.start()
        servers.append(prefill)
        d_port = await decode.start()
        servers.append(decode)
        gateway = GatewayServer(
            ServerConfig(), None, [f"127.0.0.1:{p_port}"], [f"127.0.0.1:{d_port}"], redis_url=REDIS_URL, redis_prefix=prefix
        )
        g_port = await gateway.start()
        servers.append(gateway)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{g_port}", options=channel_options()) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            prompts = random_prompts([1, 5, 16, 17, 40, 95, 160, 300] * 2, seed=40)
            params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
            results = await asyncio.gather(
                *(_collect(stub, generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params)) for p in prompts)
            )
            oracle = Oracle(llama_checkpoint)
            for prompt, (tokens, responses) in zip(prompts, results):
                assert tokens == oracle.generate(prompt, MAX_TOKENS)
                last = responses[-1]
                assert last.usage.prompt_tokens == len(prompt)
                assert last.usage.completion_tokens == len(tokens)
            info = await stub.ModelInfo(generation_pb2.ModelInfoRequest())
            assert info.block_size == 16 and info.vocab_size == 512 and list(info.eos_token_ids) == [7]
        # Every lease released, every block free on both sides.
        for _ in range(50):
            if not prefill.runtime.engine.held_request_ids and decode.runtime.async_engine.latest_stats.num_running == 0:
                break
            await asyncio.sleep(0.1)
        assert prefill.runtime.engine.held_request_ids == []
        assert decode.runtime.async_engine.latest_stats.num_free_blocks == 256
    finally:
        for server in reversed(servers):
            await server.stop()
