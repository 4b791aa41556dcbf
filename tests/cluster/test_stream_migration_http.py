"""An OpenAI streaming (SSE) completion whose decode worker goes away mid-stream goes on: the gateway moves it to
the other decode worker, and the client reads the same text as an undisturbed run, with no error event; the move is
counted in the gateway's metrics. A client that goes away while its stream moves leaves nothing behind: no request
running, no block held on the surviving workers, nothing in flight at the gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from pdserve.gateway.tokenizer import load_tokenizer
from tests.conftest import random_prompts
from tests.support.cluster import ClusterOptions, InProcessCluster

MAX_TOKENS = 60


@pytest.mark.asyncio
async def test_sse_streams_survive_their_decode_worker_going_away(chat_checkpoint: Path) -> None:
    options = ClusterOptions(num_kv_blocks=128, decode_workers=2, http=True,
                             tokenizer=load_tokenizer(str(chat_checkpoint)))
    prompts = random_prompts([15, 25, 35, 45], seed=97)
    async with InProcessCluster(chat_checkpoint, options) as cluster:
        assert cluster.gateway is not None
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.gateway.http_port}/v1", api_key="unused",
                                      max_retries=0) as client:
            async def complete(prompt: list[int]) -> str:
                reply = await client.completions.create(model="pdserve", prompt=prompt, max_tokens=MAX_TOKENS,
                                                        temperature=0.0, extra_body={"ignore_eos": True})
                return reply.choices[0].text

            undisturbed = [await complete(prompt) for prompt in prompts]
            metrics = cluster.gateway.servicer.metrics
            routed_before = {server.runtime.config.worker_id: metrics.routing_decisions.labels(
                "decode", server.runtime.config.worker_id)._value.get() for server in cluster.decodes}
            streams = [await client.completions.create(model="pdserve", prompt=prompt, max_tokens=MAX_TOKENS,
                                                       temperature=0.0, stream=True, stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True}) for prompt in prompts]
            texts = ["" for _ in streams]
            iterators = [stream.__aiter__() for stream in streams]
            for index, iterator in enumerate(iterators):
                for _ in range(8):
                    texts[index] += (await anext(iterator)).choices[0].text
            routed = {worker: metrics.routing_decisions.labels("decode", worker)._value.get() - before
                      for worker, before in routed_before.items()}
            # The decode worker with the most of these streams goes away at once: their calls fail UNAVAILABLE.
            victim = max(range(len(cluster.decodes)), key=lambda i: routed[cluster.decodes[i].runtime.config.worker_id])
            on_victim = routed[cluster.decodes[victim].runtime.config.worker_id]
            assert on_victim >= 1
            await cluster.decodes[victim].server.grpc_server.stop(0)

            async def rest(index: int) -> int:
                completion_tokens = 0
                async for chunk in iterators[index]:
                    if chunk.choices:
                        texts[index] += chunk.choices[0].text
                    if chunk.usage is not None:
                        completion_tokens = chunk.usage.completion_tokens
                return completion_tokens

            counts = await asyncio.gather(*(rest(index) for index in range(len(streams))))
        assert texts == undisturbed
        assert counts == [MAX_TOKENS] * len(prompts)
        # Each stream that was on the victim moved once.
        assert metrics.migrations.labels("decode_unavailable", "resumed")._value.get() == on_victim


@pytest.mark.asyncio
async def test_a_client_gone_during_a_migration_leaves_nothing_behind(llama_checkpoint: Path) -> None:
    from pdserve.protos.pdserve.v1 import generation_pb2
    from pdserve.protos.pdserve.v1.internal import worker_pb2
    from tests.support.waiting import wait_until

    options = ClusterOptions(num_kv_blocks=128, decode_workers=2)
    prompts = random_prompts([20, 30, 40, 50, 60, 70], seed=98)
    params = generation_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async with InProcessCluster(llama_checkpoint, options) as cluster:
        assert cluster.stub is not None and cluster.gateway is not None
        calls = [cluster.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params),
                                       timeout=60) for p in prompts]
        for call in calls:
            for _ in range(5):
                await call.read()
        await cluster.decodes[0].server.grpc_server.stop(0)
        await asyncio.sleep(0.05)  # the gateway sees the failures and starts moving the streams
        for call in calls:
            call.cancel()
        survivors = [cluster.worker_stubs[0], cluster.worker_stubs[2]]  # the prefill worker, decode worker 1

        async def loads() -> list[worker_pb2.LoadReport]:
            return [await stub.Load(worker_pb2.LoadRequest(), timeout=5) for stub in survivors]

        reports = await wait_until(loads, "the surviving workers to hold nothing of the cancelled streams", 30,
                                   until=lambda rs: all(r.num_running == r.num_waiting == 0
                                                        and r.num_free_blocks == r.num_total_blocks for r in rs))
        assert [r.num_running for r in reports] == [0, 0]
        assert cluster.gateway.servicer.admission.requests == 0  # the gateway's in-flight count too
