"""--disaggregation always|never|auto through real gRPC servers: tokens equal transformers' on local and remote prefill."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from pdserve.gateway.disaggregation import DisaggregationPolicy
from pdserve.gateway.router import RecentPrefills
from pdserve.gateway.server import GatewayServer
from pdserve.cli import build_parser
from pdserve.launcher import ClusterConfig
from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import Oracle, StartInProcessCluster, random_prompts
from tests.support.cluster import ClusterOptions, InProcessCluster
from tests.support.waiting import wait_until

MAX_TOKENS = 12
LENGTHS = [1, 5, 16, 17, 40, 95, 160, 300]
LONG = 64  # FakeCosts: prompts with more uncached tokens than this are cheaper to prefill remotely


class FakeCosts:
    """Local prefill costs nothing up to LONG uncached tokens and a lot above; nothing else costs anything."""

    def remote_first_token_s(self, tokens: int) -> float:
        return 1.0

    def handoff_s(self, tokens: int) -> float:
        return 0.0

    def local_first_token_s(self, tokens: int) -> float:
        return 0.0 if tokens <= LONG else 100.0

    def decode_stall_s(self, tokens: int) -> float:
        return 0.0

    def time_per_output_token_s(self) -> float:
        return 0.01

    def output_tokens(self) -> float:
        return 10.0


def _request(prompt: list[int], **params: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                               **params)
    )


async def _tokens(cluster: InProcessCluster, request: generation_pb2.GenerateRequest) -> tuple[list[int], generation_pb2.Usage]:
    responses = await cluster.generate(request)
    return [t for r in responses for t in r.token_ids], responses[-1].usage


def _routes(cluster: InProcessCluster) -> dict[tuple[str, str], float]:
    assert cluster.gateway is not None
    registry = cluster.gateway.servicer.metrics.registry
    counts = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == "pdserve_gateway_prefill_route_total":
                counts[(sample.labels["route"], sample.labels["reason"])] = sample.value
    return counts


async def _generate_all(cluster: InProcessCluster, prompts: list[list[int]], oracle: Oracle) -> list[generation_pb2.Usage]:
    results = await asyncio.gather(*(_tokens(cluster, _request(p)) for p in prompts))
    for prompt, (tokens, usage) in zip(prompts, results):
        assert tokens == oracle.generate(prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(tokens))
    return [usage for _, usage in results]


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["always", "never"])
async def test_always_and_never_prefill_every_prompt_where_they_say(
    mode: str, llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(num_kv_blocks=256, disaggregation=mode)
    )
    prompts = random_prompts(LENGTHS, seed=131)
    await _generate_all(cluster, prompts, Oracle(llama_checkpoint))
    route = "remote" if mode == "always" else "local"
    assert _routes(cluster) == {(route, "forced"): len(prompts)}
    reports = await cluster.wait_idle()
    prefill_report, decode_report = reports
    # Remote: every prompt's KV reached the decode worker (or was recomputed there); local: none travelled.
    handoffs = decode_report.kv_transfers + decode_report.kv_recomputes
    assert handoffs == (len(prompts) if mode == "always" else 0)
    assert cluster.prefill.runtime.engine.leases.request_ids == []


@pytest.mark.asyncio
async def test_auto_prefills_short_prompts_locally_and_long_ones_remotely(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256, disaggregation="auto"))
    assert cluster.gateway is not None
    # auto is the default of the gateway (and of `pdserve up`, test_a_bad_disaggregation_value_is_a_clear_cli_error).
    assert inspect.signature(GatewayServer).parameters["disaggregation"].default == "auto"
    cluster.gateway.servicer.disaggregation = DisaggregationPolicy("auto", FakeCosts())
    prompts = random_prompts(LENGTHS, seed=132)
    # One at a time: with nothing running on the decode worker every decision is decode_idle or cheaper.
    oracle = Oracle(llama_checkpoint)
    for prompt in prompts:
        await _generate_all(cluster, [prompt], oracle)
    num_long = sum(n > LONG for n in LENGTHS)
    assert _routes(cluster) == {("local", "decode_idle"): len(prompts) - num_long, ("remote", "cheaper"): num_long}
    _, decode_report = await cluster.wait_idle()
    assert decode_report.kv_transfers + decode_report.kv_recomputes == num_long


@pytest.mark.asyncio
async def test_auto_with_measured_costs_is_exact_under_concurrency_and_learns(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256, disaggregation="auto"))
    assert cluster.gateway is not None
    prompts = random_prompts(LENGTHS * 2, seed=133)
    await _generate_all(cluster, prompts, Oracle(llama_checkpoint))
    routes = _routes(cluster)
    assert sum(routes.values()) == len(prompts)
    costs = cluster.gateway.servicer.disaggregation.costs
    # Every finished request taught the model its side's first-token cost.
    assert costs.local.observations + costs.remote.observations == len(prompts)  # type: ignore[attr-defined]
    assert costs.local.observations == sum(n for (route, _), n in routes.items() if route == "local")  # type: ignore[attr-defined]
    await cluster.wait_idle()


@pytest.mark.asyncio
async def test_a_prefix_the_decode_worker_holds_per_redis_makes_a_longer_prompt_local(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    options = ClusterOptions(num_kv_blocks=256, redis=True, disaggregation="auto")
    cluster = await start_inprocess_cluster(llama_checkpoint, options)
    assert cluster.gateway is not None
    cluster.gateway.servicer.disaggregation = DisaggregationPolicy("auto", FakeCosts())
    first, more = random_prompts([60, 50], seed=134)
    oracle = Oracle(llama_checkpoint)
    # The first turn is short: prefilled on the decode worker, which then caches its 3 full blocks.
    await _generate_all(cluster, [first], oracle)
    router, decode = cluster.gateway.router, cluster.gateway.router.pool.healthy("decode")[0]
    router.recent = RecentPrefills()  # forget what this gateway saw: only the Redis index tells now
    await wait_until(lambda: router.decode_cached_tokens(decode, first), "the decode worker's blocks in the index",
                     until=lambda cached: cached == 48)
    # The next turn has 110 tokens: 62 left to compute on the decode worker, 110 on the prefill worker.
    [usage] = await _generate_all(cluster, [first + more], oracle)
    assert _routes(cluster) == {("local", "decode_idle"): 1, ("local", "prefix_hit"): 1}
    assert usage.cached_prompt_tokens == 48
    await cluster.wait_idle()


@pytest.mark.asyncio
async def test_never_still_sends_prompt_logprobs_to_a_prefill_worker_and_a_decode_only_cluster_prefills_locally(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(num_kv_blocks=256, disaggregation="never")
    )
    [prompt] = random_prompts([30], seed=135)
    responses = await cluster.generate(_request(prompt, prompt_logprobs=0))
    assert len(responses[0].prompt_logprobs) == len(prompt) - 1
    assert _routes(cluster) == {("remote", "prompt_logprobs"): 1}
    await cluster.wait_idle()

    options = ClusterOptions(num_kv_blocks=256, prefill_workers=0, disaggregation="auto")
    decode_only = await start_inprocess_cluster(llama_checkpoint, options)
    assert decode_only.gateway is not None
    await wait_until(lambda: _healthy_decode(decode_only), "the gateway to see the decode worker")
    await _generate_all(decode_only, [prompt], Oracle(llama_checkpoint))
    assert _routes(decode_only) == {("local", "no_prefill_worker"): 1}


def _healthy_decode(cluster: InProcessCluster) -> bool:
    assert cluster.gateway is not None
    return bool(cluster.gateway.router.pool.healthy("decode"))


@pytest.mark.asyncio
async def test_cancelling_a_local_prefill_stream_frees_its_blocks(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(num_kv_blocks=256, disaggregation="never")
    )
    assert cluster.stub is not None
    [prompt] = random_prompts([100], seed=136)
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(max_tokens=900, ignore_eos=True)
    )
    call = cluster.stub.Generate(request, timeout=30)
    async for _ in call:
        break  # the first token came from the decode worker: cancel mid-stream
    call.cancel()
    await cluster.wait_idle()
    assert cluster.gateway is not None
    decode = cluster.gateway.router.pool.healthy("decode")[0]
    assert (decode.inflight_requests, decode.inflight_tokens) == (0, 0)


def test_a_bad_disaggregation_value_is_a_clear_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("gateway", "up"):
        with pytest.raises(SystemExit) as caught:
            build_parser().parse_args([command, "--disaggregation", "sometimes"])
        assert caught.value.code == 2
        assert ("argument --disaggregation: invalid choice: 'sometimes' (choose from 'always', 'never', 'auto')"
                in capsys.readouterr().err)
    assert build_parser().parse_args(["gateway"]).disaggregation == "auto"
    assert build_parser().parse_args(["up", "--disaggregation", "never"]).disaggregation == "never"


def test_the_stall_budget_flag_reaches_the_gateway_and_refuses_a_negative_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("gateway", "up"):
        assert build_parser().parse_args([command]).max_tpot_increase == 0.1
        assert build_parser().parse_args([command, "--max-tpot-increase", "0.25"]).max_tpot_increase == 0.25
        for bad, message in (("-0.1", "must be >= 0, got -0.1"), ("lots", "not a number: 'lots'")):
            with pytest.raises(SystemExit) as caught:
                build_parser().parse_args([command, "--max-tpot-increase", bad])
            assert caught.value.code == 2
            assert f"argument --max-tpot-increase: {message}" in capsys.readouterr().err
    assert ClusterConfig().max_tpot_increase == 0.1
    assert inspect.signature(GatewayServer).parameters["max_tpot_increase"].default == 0.1
