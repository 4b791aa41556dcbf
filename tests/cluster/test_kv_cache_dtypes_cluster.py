"""int8 KV through the whole cluster (gateway, prefill and decode servers, gRPC KV transfer), in one process."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest

from pdserve.decode_service.server import DecodeServer
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.gateway.server import GatewayServer
from pdserve.prefill_service.server import PrefillServer
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.service_common.server import ServerConfig, channel_options
from pdserve.service_common.worker import WorkerConfig
from tests.conftest import random_prompts

REDIS_URL = "redis://127.0.0.1:6379/0"
MAX_TOKENS = 24


def _engine(path: Path, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                                  cache=CacheConfig(num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype)))


async def _tokens(stub: generation_pb2_grpc.GenerationStub, prompt: list[int]) -> list[int]:
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    async for response in stub.Generate(
        generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params), timeout=60
    ):
        tokens.extend(response.token_ids)
    return tokens


@pytest.mark.asyncio
@pytest.mark.parametrize("prefill_kv_dtype", ["int8", "auto"])
async def test_int8_decode_worker_through_the_cluster_equals_an_int8_engine_in_process(
    llama_checkpoint: Path, prefill_kv_dtype: str
) -> None:
    prompts = random_prompts([1, 16, 17, 40, 95, 160], seed=41)
    expected = [
        out.token_ids
        for out in LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=256, kv_cache_dtype="int8").generate(
            prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        )
    ]
    prefix = f"pdserve-test-{uuid.uuid4().hex}"
    prefill = PrefillServer(_engine(llama_checkpoint, prefill_kv_dtype), ServerConfig(),
                            WorkerConfig("prefill", "p0", REDIS_URL, prefix))
    decode = DecodeServer(_engine(llama_checkpoint, "int8"), ServerConfig(), WorkerConfig("decode", "d0", REDIS_URL, prefix))
    # The descriptor says what the prefill side holds; the decode side converts if it differs.
    assert prefill.runtime.engine.kv_layout.dtype == {"int8": "int8", "auto": "float32"}[prefill_kv_dtype]
    servers: list = []
    try:
        p_port = await prefill.start()
        servers.append(prefill)
        d_port = await decode.start()
        servers.append(decode)
        gateway = GatewayServer(
            ServerConfig(), None, [f"127.0.0.1:{p_port}"], [f"127.0.0.1:{d_port}"], redis_url=REDIS_URL, redis_prefix=prefix,
            disaggregation="always",  # every prompt's KV travels: that is what this test measures
        )
        g_port = await gateway.start()
        servers.append(gateway)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{g_port}", options=channel_options()) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            results = await asyncio.gather(*(_tokens(stub, prompt) for prompt in prompts))
        assert list(results) == expected
        # 23 blocks travelled (1 + 1 + 2 + 3 + 6 + 10): 3,840 bytes each in int8, 12,288 in float32.
        assert decode.servicer.kv_bytes_received == 23 * {"int8": 3_840, "auto": 12_288}[prefill_kv_dtype]
    finally:
        for server in reversed(servers):
            await server.stop()
