"""Worker crashes under load: clients get a clear status quickly, new requests go elsewhere."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.service_common.server import channel_options
from tests.conftest import random_prompts
from tests.e2e.conftest import cluster_config, generate, stream_outcome
from tests.support.waiting import wait_until


@pytest.mark.asyncio
async def test_without_migration_a_killed_decode_worker_fails_its_streams_with_unavailable_and_traffic_moves_on(
    llama_checkpoint: Path, start_cluster
) -> None:
    # --max-migrations 0: streams do not move (tests/e2e/test_stream_migration.py covers the default).
    cluster = start_cluster(cluster_config(llama_checkpoint, decode_workers=2, gateway_args=("--max-migrations", "0")))
    prompts = random_prompts([40, 60, 80, 100], seed=70)
    long_run = generation_pb2.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(cluster.endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=long_run), timeout=60) for p in prompts]
        # Every stream has started decoding before the crash.
        for call in calls:
            await call.read()
            await call.read()
        cluster.kill("decode-0")

        codes = await asyncio.gather(*(stream_outcome(c) for c in calls))
    # The streams on the dead worker end with UNAVAILABLE (a hang would end in
    # DEADLINE_EXCEEDED after 60 s and fail here); the others finish normally.
    assert grpc.StatusCode.UNAVAILABLE in codes
    assert set(codes) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK}
    # New requests are routed to the surviving decode worker: the gateway took the dead one out of
    # rotation when its streams failed, before it answered them UNAVAILABLE; nothing to wait for.
    short = generation_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        responses = await generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=short))
        assert sum(len(r.token_ids) for r in responses) == 8


@pytest.mark.asyncio
async def test_sigterm_drains_in_flight_requests_then_exits_zero(llama_checkpoint: Path, start_cluster) -> None:
    import signal

    cluster = start_cluster(cluster_config(llama_checkpoint))
    prompt = random_prompts([50], seed=71)[0]
    params = generation_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(cluster.endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params), timeout=60)
        received = len((await call.read()).token_ids) + len((await call.read()).token_ids)
        decode = cluster.process("decode-0")
        decode.send_signal(signal.SIGTERM)
        # The running stream finishes in full while the worker drains...
        while (response := await call.read()) is not grpc.aio.EOF:
            received += len(response.token_ids)
        assert received == 400
        assert await call.code() == grpc.StatusCode.OK
    # ...then the worker exits cleanly, and the gateway has no decode worker left.
    assert await asyncio.to_thread(decode.wait, 30) == 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.asyncio
async def test_requests_on_a_crashed_prefill_worker_are_retried_elsewhere_and_none_is_lost(
    llama_checkpoint: Path, start_cluster
) -> None:
    import signal

    from tests.conftest import Oracle

    cluster = start_cluster(cluster_config(llama_checkpoint, prefill_workers=2))
    prompts = random_prompts([30, 60, 90, 120, 150, 180, 210, 240], seed=72)
    params = generation_pb2.SamplingParams(max_tokens=12, temperature=0.0)
    # Freeze prefill-0: requests routed to it hang until it is killed, as with a crash mid-prefill.
    frozen = cluster.process("prefill-0")
    frozen.send_signal(signal.SIGSTOP)
    try:
        pending = [
            asyncio.create_task(generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params)))
            for p in prompts
        ]
        # Once the gateway marks the frozen worker unreachable (its load poll timed out after 1 s), every
        # request has long been routed; those sent to prefill-0 are stuck there.
        frozen_address = cluster.prefill_addresses[0]
        await wait_until(lambda: f"prefill worker at {frozen_address} is unreachable" in cluster.log_of("gateway"),
                         "the gateway to mark the frozen prefill-0 unreachable")
    finally:
        cluster.kill("prefill-0")
    results = await asyncio.gather(*pending)
    oracle = Oracle(llama_checkpoint)
    for prompt, responses in zip(prompts, results):
        assert [t for r in responses for t in r.token_ids] == oracle.generate(prompt, 12)
