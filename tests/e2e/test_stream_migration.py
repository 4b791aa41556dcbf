"""Streams that outlive their decode worker: kill -9 of a decode worker mid-stream, and every stream it served
continues on the other one, token for token as an undisturbed run (greedy: transformers' continuation; seeded
sampling: the same cluster's run before the kill), with usage counting the prompt once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.server import channel_options
from tests.conftest import greedy_continuations, random_prompts
from tests.e2e.conftest import cluster_config, generate

MAX_TOKENS = 160
KILL_AFTER = 40


async def _busiest_decode(cluster) -> str:  # noqa: ANN001 - LocalCluster
    """The decode worker running the most streams (the router may have sent them all to one)."""
    from tests.e2e.conftest import load

    running = [(await load(address, "decode")).num_running for address in cluster.decode_addresses]
    assert max(running) >= 1
    return f"decode-{running.index(max(running))}"


async def _read_all(call: grpc.aio.UnaryStreamCall, received: list[generation_pb2.GenerateResponse]) -> None:
    while (response := await call.read()) is not grpc.aio.EOF:
        received.append(response)


@pytest.mark.asyncio
async def test_streams_of_a_killed_decode_worker_continue_on_another_token_for_token(
    llama_checkpoint: Path, start_cluster
) -> None:
    cluster = start_cluster(cluster_config(llama_checkpoint, decode_workers=2))
    prompts = random_prompts([20 + 7 * i for i in range(12)], seed=95)
    greedy = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def seeded(index: int) -> generation_pb2.SamplingParams:
        return generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=1000 + index,
                                             ignore_eos=True)

    requests = [generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=greedy) for p in prompts]
    requests += [generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=seeded(i))
                 for i, p in enumerate(prompts)]
    # The seeded streams undisturbed, first.
    undisturbed = await asyncio.gather(*(generate(cluster.endpoint, r) for r in requests[12:]))
    async with grpc.aio.insecure_channel(cluster.endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [stub.Generate(request, timeout=120) for request in requests]
        received: list[list[generation_pb2.GenerateResponse]] = [[] for _ in calls]
        for call, responses in zip(calls, received):
            while sum(len(r.token_ids) for r in responses) < KILL_AFTER:
                responses.append(await call.read())
        cluster.kill(await _busiest_decode(cluster))
        await asyncio.gather(*(_read_all(call, responses) for call, responses in zip(calls, received)))
    tokens = [[t for r in responses for t in r.token_ids] for responses in received]
    assert tokens[:12] == greedy_continuations(llama_checkpoint, prompts, MAX_TOKENS)
    assert tokens[12:] == [[t for r in responses for t in r.token_ids] for responses in undisturbed]
    for request, responses in zip(requests, received):
        last = responses[-1]
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(request.prompt_token_ids), MAX_TOKENS)
    # Some streams were on decode-0 and moved.
    assert "moving gw-" in cluster.log_of("gateway")


@pytest.mark.asyncio
async def test_requests_of_a_killed_only_prefill_worker_are_prefilled_on_a_decode_worker_and_exact(
    llama_checkpoint: Path, start_cluster
) -> None:
    import signal

    from tests.support.waiting import wait_until

    # One prefill worker, --disaggregation auto: when it fails a prefill, the decode workers prefill locally.
    cluster = start_cluster(cluster_config(llama_checkpoint, decode_workers=2, disaggregation="auto"))
    prompts = random_prompts([300 + 25 * i for i in range(12)], seed=98)
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    frozen = cluster.process("prefill-0")
    frozen.send_signal(signal.SIGSTOP)  # requests routed to it hang there, as in a crash mid-prefill
    try:
        pending = [asyncio.create_task(generate(cluster.endpoint, generation_pb2.GenerateRequest(
            prompt_token_ids=p, sampling_params=params), timeout=120)) for p in prompts]
        address = cluster.prefill_addresses[0]
        await wait_until(lambda: f"prefill worker at {address} is unreachable" in cluster.log_of("gateway"),
                         "the gateway to mark the frozen prefill-0 unreachable")
    finally:
        cluster.kill("prefill-0")
    results = await asyncio.gather(*pending)
    for responses, expected in zip(results, greedy_continuations(llama_checkpoint, prompts, MAX_TOKENS)):
        assert [t for r in responses for t in r.token_ids] == expected
        assert responses[-1].usage.completion_tokens == MAX_TOKENS
    # Some had been sent to the frozen worker and were prefilled again after it died.
    assert f"prefill worker {cluster.prefill_addresses[0]} failed for" in cluster.log_of("gateway")


@pytest.mark.asyncio
async def test_streams_of_a_frozen_decode_worker_move_and_it_frees_their_kv_when_it_wakes(
    llama_checkpoint: Path, start_cluster
) -> None:
    """SIGSTOP: the worker holds its connections but answers nothing, as behind a partition. The gateway's keepalive
    (pdserve/service_common/server.py, WORKER_KEEPALIVE_MS) drops it, its streams move; woken, it finds their
    calls gone, ends them and frees their blocks."""
    import signal

    from tests.e2e.conftest import load
    from tests.support.waiting import wait_until

    cluster = start_cluster(cluster_config(llama_checkpoint, decode_workers=2))
    prompts = random_prompts([30 + 9 * i for i in range(6)], seed=99)
    greedy = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(cluster.endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=greedy), timeout=120)
                 for p in prompts]
        received: list[list[generation_pb2.GenerateResponse]] = [[] for _ in calls]
        for call, responses in zip(calls, received):
            while sum(len(r.token_ids) for r in responses) < KILL_AFTER:
                responses.append(await call.read())
        victim = await _busiest_decode(cluster)
        frozen = cluster.process(victim)
        frozen.send_signal(signal.SIGSTOP)
        try:
            await asyncio.gather(*(_read_all(call, responses) for call, responses in zip(calls, received)))
        finally:
            frozen.send_signal(signal.SIGCONT)
    tokens = [[t for r in responses for t in r.token_ids] for responses in received]
    assert tokens == greedy_continuations(llama_checkpoint, prompts, MAX_TOKENS)
    assert "moving gw-" in cluster.log_of("gateway")

    async def idle() -> worker_pb2.LoadReport:
        return await load(cluster.decode_addresses[int(victim.rsplit("-", 1)[1])], "decode")

    report = await wait_until(idle, "the woken decode worker to end the moved streams and free their blocks", 30,
                              until=lambda r: r.num_running == 0 and r.num_free_blocks == r.num_total_blocks)
    assert (report.num_running, report.num_waiting) == (0, 0)
