"""An OpenAI streaming (SSE) completion whose decode worker goes away mid-stream goes on: the gateway moves it to
the other decode worker, and the client reads the same text as an undisturbed run, with no error event; the move is
counted in the gateway's metrics. A client that goes away while its stream moves (the move begun, no token yet from
the worker it moves to) leaves nothing behind: no request running, no block held on the surviving workers, nothing in
flight at the gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from pdserve.gateway.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from tests.conftest import random_prompts
from tests.support.cluster import ClusterOptions, InProcessCluster
from tests.support.held_step import HeldStep
from tests.support.waiting import wait_until

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
            routed_before = _routed_to_decodes(cluster)
            streams = [await client.completions.create(model="pdserve", prompt=prompt, max_tokens=MAX_TOKENS,
                                                       temperature=0.0, stream=True, stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True}) for prompt in prompts]
            texts = ["" for _ in streams]
            iterators = [stream.__aiter__() for stream in streams]
            for index, iterator in enumerate(iterators):
                for _ in range(8):
                    texts[index] += (await anext(iterator)).choices[0].text
            # The decode worker with the most of these streams goes away at once: their calls fail UNAVAILABLE.
            victim, on_victim = _busiest_decode(cluster, routed_before)
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
    options = ClusterOptions(num_kv_blocks=128, decode_workers=2)
    prompts = random_prompts([20, 30, 40, 50, 60, 70], seed=98)
    params = generation_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async with InProcessCluster(llama_checkpoint, options) as cluster:
        assert cluster.stub is not None and cluster.gateway is not None
        metrics = cluster.gateway.servicer.metrics
        routed_before = _routed_to_decodes(cluster)
        calls = [cluster.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params),
                                       timeout=60) for p in prompts]
        for call in calls:
            for _ in range(5):
                await call.read()
        victim, on_victim = _busiest_decode(cluster, routed_before)
        assert on_victim >= 1
        survivor = 1 - victim
        survivor_id = cluster.decodes[survivor].runtime.config.worker_id
        survivor_routed = _routed_to_decodes(cluster)[survivor_id]
        # The survivor's engine stops at its next step, so a moved stream cannot get its first token there
        # before its client leaves: the client leaves while the stream moves, not after.
        held = HeldStep(cluster.decodes[survivor].runtime.engine)
        held.armed.set()
        try:
            await cluster.decodes[victim].server.grpc_server.stop(0)
            # Each of the victim's streams begins its move: the gateway sends it to the survivor.
            moved = await wait_until(lambda: _routed_to_decodes(cluster)[survivor_id] - survivor_routed,
                                     "the victim's streams to move to the surviving decode worker", 30,
                                     until=lambda n: n >= on_victim)
            assert moved == on_victim
            for call in calls:
                call.cancel()
            await wait_until(lambda: cluster.gateway.servicer.admission.requests,  # type: ignore[union-attr]
                             "the gateway to end the cancelled streams", 30, until=lambda n: n == 0)
        finally:
            held.release.set()
        assert metrics.requests.labels("cancelled")._value.get() == len(prompts)
        # No move got as far as a token from the survivor: every one was under way when its client left.
        assert metrics.migrations.labels("decode_unavailable", "resumed")._value.get() == 0
        survivors = [cluster.worker_stubs[0], cluster.worker_stubs[1 + survivor]]  # the prefill worker, the survivor

        async def loads() -> list[worker_pb2.LoadReport]:
            return [await stub.Load(worker_pb2.LoadRequest(), timeout=5) for stub in survivors]

        reports = await wait_until(loads, "the surviving workers to hold nothing of the cancelled streams", 30,
                                   until=lambda rs: all(r.num_running == r.num_waiting == 0
                                                        and r.num_free_blocks == r.num_total_blocks for r in rs))
        assert [r.num_running for r in reports] == [0, 0]
        assert cluster.gateway.servicer.admission.requests == 0  # the gateway's in-flight count too


def _routed_to_decodes(cluster: InProcessCluster) -> dict[str, float]:
    """How many streams the gateway has sent to each decode worker (moves included), by worker id."""
    assert cluster.gateway is not None
    decisions = cluster.gateway.servicer.metrics.routing_decisions
    return {server.runtime.config.worker_id: decisions.labels("decode", server.runtime.config.worker_id)._value.get()
            for server in cluster.decodes}


def _busiest_decode(cluster: InProcessCluster, routed_before: dict[str, float]) -> tuple[int, int]:
    """The index of the decode worker sent the most streams since ``routed_before`` (the router may send a burst
    to one), and how many it was sent."""
    routed = {worker: count - routed_before[worker] for worker, count in _routed_to_decodes(cluster).items()}
    busiest = max(range(len(cluster.decodes)), key=lambda i: routed[cluster.decodes[i].runtime.config.worker_id])
    return busiest, int(routed[cluster.decodes[busiest].runtime.config.worker_id])
