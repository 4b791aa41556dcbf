"""Gateway, prefill and decode servers in one process on ephemeral loopback ports, with real Redis."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest

from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.service_common.server import channel_options
from tests.conftest import Oracle, StartInProcessCluster, random_prompts
from tests.support.cluster import ClusterOptions
from tests.support.waiting import wait_until

MAX_TOKENS = 24


async def _collect(stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest) -> tuple[list[int], list]:
    tokens: list[int] = []
    responses = []
    async for response in stub.Generate(request, timeout=60):
        tokens.extend(response.token_ids)
        responses.append(response)
    return tokens, responses


@pytest.mark.asyncio
async def test_cluster_in_process_equals_transformers(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256, redis=True))
    prefill, decode, stub = cluster.prefill, cluster.decode, cluster.stub
    assert stub is not None
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
    await wait_until(
        lambda: not prefill.runtime.engine.leases.request_ids and decode.runtime.async_engine.latest_stats.num_running == 0,
        "every lease released and every decode finished",
    )
    assert prefill.runtime.engine.leases.request_ids == []
    assert decode.runtime.async_engine.latest_stats.num_free_blocks == 256


@pytest.mark.asyncio
async def test_gateway_serves_health_and_reflection_and_rejects_bad_prompts(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=32))
    assert cluster.channel is not None and cluster.stub is not None
    health = await health_pb2_grpc.HealthStub(cluster.channel).Check(
        health_pb2.HealthCheckRequest(service="pdserve.v1.Generation")
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(cluster.channel)
    responses = [
        r async for r in reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    ]
    names = sorted(s.name for s in responses[0].list_services_response.service)
    assert names == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "pdserve.v1.Generation"]

    stub = cluster.stub
    params = generation_pb2.SamplingParams(max_tokens=4)
    bad = [
        (generation_pb2.GenerateRequest(sampling_params=params), "prompt must not be empty"),
        (generation_pb2.GenerateRequest(prompt="x", prompt_token_ids=[1], sampling_params=params), "exactly one"),
        (generation_pb2.GenerateRequest(prompt="text", sampling_params=params), "tokenizer"),
        (generation_pb2.GenerateRequest(prompt_token_ids=[1, 600], sampling_params=params), "outside the vocabulary"),
        (generation_pb2.GenerateRequest(prompt_token_ids=[1], sampling_params=generation_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
        (generation_pb2.GenerateRequest(prompt_token_ids=[1], sampling_params=generation_pb2.SamplingParams(top_p=1.5)), "top_p"),
    ]
    for request, message in bad:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _collect(stub, request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()
    tokens, _ = await _collect(stub, generation_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=params))
    assert len(tokens) == 4 or tokens[-1] == 7


@pytest.mark.asyncio
async def test_a_dead_engine_thread_fails_requests_and_turns_health_to_not_serving(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc

    options = ClusterOptions(num_kv_blocks=32, decode_workers=0, gateway=False)
    cluster = await start_inprocess_cluster(llama_checkpoint, options)
    engine = cluster.prefill.runtime.engine

    def broken_step() -> list:
        raise RuntimeError("simulated engine failure")

    engine.step = broken_step  # type: ignore[method-assign]
    async with grpc.aio.insecure_channel(cluster.prefill_addresses[0], options=channel_options()) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        request = worker_pb2.PrefillRequest(
            request_id="r1", prompt_token_ids=[1, 2, 3], sampling_params=generation_pb2.SamplingParams(max_tokens=4)
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Prefill(request, timeout=20)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "simulated engine failure" in caught.value.details()
        health = health_pb2_grpc.HealthStub(channel)

        async def health_status() -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=""))).status

        # The watchdog looks every 0.5 s.
        status = await wait_until(health_status, "health NOT_SERVING",
                                  until=lambda status: status == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Load(worker_pb2.LoadRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.asyncio
async def test_over_the_admission_limit_a_prefill_gets_resource_exhausted_at_once(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    from pdserve.protos.pdserve.v1.internal import worker_pb2

    options = ClusterOptions(
        num_kv_blocks=256, decode_workers=0, gateway=False, max_queued_requests=8, max_queued_tokens=400
    )
    cluster = await start_inprocess_cluster(llama_checkpoint, options)
    stub = cluster.worker_stubs[0]
    params = generation_pb2.SamplingParams(max_tokens=1)
    prompts = random_prompts([300] * 4, seed=41)

    async def prefill_one(index: int) -> grpc.StatusCode:
        request = worker_pb2.PrefillRequest(request_id=f"r{index}", prompt_token_ids=prompts[index], sampling_params=params)
        try:
            await stub.Prefill(request, timeout=30)  # type: ignore[union-attr]
        except grpc.aio.AioRpcError as error:
            assert "admission limit" in (error.details() or "")
            return error.code()
        return grpc.StatusCode.OK

    # The engine is busy until the refusals are in, so that the admitted request is still queued
    # when the others arrive however slowly this machine runs them.
    busy = threading.Event()
    cluster.prefill.runtime.async_engine.submit(lambda engine: busy.wait(timeout=60))
    try:
        calls = [asyncio.create_task(prefill_one(i)) for i in range(4)]
        await wait_until(lambda: sum(call.done() for call in calls) == 3, "three of the four prefills refused")
    finally:
        busy.set()
    codes = await asyncio.gather(*calls)
    # Whichever arrives first fits the empty queue; 300 more tokens would exceed 400.
    assert sorted(code.value[0] for code in codes) == [0, 8, 8, 8]  # OK, then RESOURCE_EXHAUSTED x3
    # Once the queue drains, requests are admitted again.
    assert await prefill_one(1) == grpc.StatusCode.OK


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_unfetchable_kv_is_recomputed_or_fails_per_policy(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster, policy: str
) -> None:
    import socket

    from pdserve.kv_transfer.descriptor import KVHandoff, KVLayout, handoff_to_proto
    from pdserve.protos.pdserve.v1.internal import worker_pb2

    with socket.socket() as probe:  # a loopback port nobody listens on: the prefill worker is gone
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    options = ClusterOptions(num_kv_blocks=64, prefill_workers=0, gateway=False, kv_failure_policy=policy)
    cluster = await start_inprocess_cluster(llama_checkpoint, options)
    stub = cluster.worker_stubs[0]
    prompt = random_prompts([45], seed=42)[0]
    expected = Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    handoff = KVHandoff(
        request_id="orphan", model_id=str(llama_checkpoint), layout=KVLayout(3, 2, 16, 16, "float32"),
        block_hashes=(), num_tokens=len(prompt), first_token_id=expected[0], transport="grpc", address=dead,
        lease_deadline_ms=2**40, worker_id="gone", epoch=1,
    )
    request = worker_pb2.DecodeRequest(
        request_id="orphan", prompt_token_ids=prompt, handoff=handoff_to_proto(handoff),
        sampling_params=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
    )
    if policy == "fail":
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in stub.Decode(request, timeout=30)]  # type: ignore[union-attr]
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dead in caught.value.details()
    else:
        tokens = [t async for r in stub.Decode(request, timeout=30) for t in r.token_ids]  # type: ignore[union-attr]
        # Never truncated or corrupted: exactly what the model gives after the first token.
        assert tokens == expected[1:]
    # The request's abort reaches the engine in the background, after the RPC that ended it returned.
    (report,) = await cluster.wait_idle()
    assert report.kv_recomputes == (1 if policy == "recompute" else 0)
    assert (report.num_running, report.num_free_blocks) == (0, 64)


@pytest.mark.asyncio
async def test_over_the_gateway_admission_limit_requests_get_resource_exhausted(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=64, max_inflight_requests=1))
    stub = cluster.stub
    assert stub is not None
    params = generation_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    request = generation_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=params)

    async def outcome() -> int:
        try:
            tokens, _ = await _collect(stub, request)
            assert len(tokens) == 200
            return grpc.StatusCode.OK.value[0]
        except grpc.aio.AioRpcError as error:
            assert "admission limit" in (error.details() or "")
            return error.code().value[0]

    codes = await asyncio.gather(*(outcome() for _ in range(3)))
    assert sorted(codes) == [0, 8, 8]  # one OK, two RESOURCE_EXHAUSTED
    assert await outcome() == 0  # admitted again once idle


@pytest.mark.asyncio
async def test_a_handoff_through_the_services_hashes_each_prompt_block_once(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdserve.engine.sequence
    import pdserve.engine.types.hashing

    # No Redis: the gateway routes by load and hashes nothing; what is counted is the workers' hashing.
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=64))
    assert cluster.stub is not None
    hashed: list[list[int]] = []
    for module in (pdserve.engine.sequence, pdserve.engine.types.hashing):  # the engines' sequences, and hash_prompt_blocks

        def counting(parent, token_ids, model_id, real=module.hash_block):  # noqa: ANN001, ANN202
            hashed.append(list(token_ids))
            return real(parent, token_ids, model_id)

        monkeypatch.setattr(module, "hash_block", counting)
    prompt = random_prompts([37], seed=47)[0]  # 2 full blocks; 37 + 8 tokens never fill a third
    params = generation_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, _ = await _collect(cluster.stub, generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params))
    assert tokens == Oracle(llama_checkpoint).generate(prompt, 8)
    # Hashed by the prefill engine as the prompt was computed; the prefill service and the decode
    # engine took those hashes from the handoff (before: each block hashed three times here).
    assert hashed == [prompt[:16], prompt[16:32]]
    assert cluster.decode.runtime.engine.block_manager.num_cached_blocks == 2
