"""The whole system as real processes: gateway, prefill, KV transfer, decode, Redis."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import pytest

from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import Oracle, random_prompts
from tests.e2e.conftest import cluster_config, generate, load
from tests.support.waiting import wait_until

MAX_TOKENS = 20
LENGTHS = [1, 3, 9, 16, 17, 31, 33, 48, 64, 80, 100, 130, 170, 220, 260, 300]


def _tokens(responses: list) -> list[int]:
    return [t for r in responses for t in r.token_ids]


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["grpc", "shm", "torch_dist"])
async def test_cluster_greedy_equals_transformers_for_each_transport(
    llama_checkpoint: Path, start_cluster, transport: str
) -> None:
    # The prefill worker yields the cores to the decode worker (`pdserve up --prefill-niceness`).
    cluster = start_cluster(cluster_config(llama_checkpoint, kv_transport=transport, prefill_args=("--niceness", "5")))
    prompts = random_prompts(LENGTHS, seed=50)
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = await asyncio.gather(
        *(generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params)) for p in prompts)
    )
    oracle = Oracle(llama_checkpoint)
    for prompt, responses in zip(prompts, results):
        assert _tokens(responses) == oracle.generate(prompt, MAX_TOKENS), f"{len(prompt)}-token prompt via {transport}"
        assert responses[-1].usage.completion_tokens == len(_tokens(responses))
    # Every lease was released and every decode sequence freed.
    report = await load(cluster.decode_addresses[0], "decode")
    assert (report.num_running, report.num_free_blocks) == (0, 256)
    # The engines share this machine's cores: each governs its OpenMP spin (--openmp-spin adaptive), so the
    # launcher leaves OMP_WAIT_POLICY as the test's environment has it.
    policy = os.environ.get("OMP_WAIT_POLICY")
    for name in ("prefill-0", "decode-0"):
        assert _wait_policy_settings(cluster.process(name).pid) == _this_wait_policy(), name
        governed = "OpenMP spin: adaptive" in cluster.log_of(name)
        assert governed is ((policy or "").lower() != "passive" and len(os.sched_getaffinity(0)) > 1), name
    # Every thread of the prefill worker (torch's, gRPC's, the engine's) runs at niceness 5; the decode worker's at 0.
    for name, niceness in (("prefill-0", 5), ("decode-0", 0)):
        tasks = Path(f"/proc/{cluster.process(name).pid}/task")
        nice = {int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]) for task in tasks.iterdir()}
        assert nice == {niceness}, name


def _wait_policy_settings(pid: int) -> list[bytes]:
    """The ``OMP_WAIT_POLICY=...`` entries of process ``pid``'s environment (none where it is not set)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return [entry for entry in environ if entry.startswith(b"OMP_WAIT_POLICY=")]


def _this_wait_policy() -> list[bytes]:
    """What ``_wait_policy_settings`` gives for a child that inherits this process's environment unchanged."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    return [f"OMP_WAIT_POLICY={policy}".encode()] if policy is not None else []


async def _wait_idle(cluster) -> tuple:  # noqa: ANN001 - a LocalCluster
    """Both workers' load reports once nothing runs and every block is free."""

    async def reports() -> tuple:
        return await load(cluster.prefill_addresses[0], "prefill"), await load(cluster.decode_addresses[0], "decode")

    def idle(reports: tuple) -> bool:
        prefill, decode = reports
        return prefill.num_free_blocks == decode.num_free_blocks == 256 and decode.num_running == 0

    return await wait_until(reports, "both workers idle with every block free", until=idle)


@pytest.mark.asyncio
async def test_client_cancel_and_deadline_free_blocks_on_both_workers(llama_checkpoint: Path, start_cluster) -> None:
    import grpc

    from pdserve.protos.pdserve.v1 import generation_pb2_grpc
    from pdserve.service_common.server import channel_options

    cluster = start_cluster(cluster_config(llama_checkpoint))
    prompt = random_prompts([100], seed=51)[0]
    long_run = generation_pb2.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=long_run)
    async with grpc.aio.insecure_channel(cluster.endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(request, timeout=60)
        received = 0
        async for response in call:
            received += len(response.token_ids)
            if received >= 5:
                break
        call.cancel()
        started = time.monotonic()
        prefill, decode = await _wait_idle(cluster)
        assert (decode.num_running, decode.num_free_blocks, prefill.num_free_blocks) == (0, 256, 256)
        assert time.monotonic() - started < 1.0

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(request, timeout=0.3):
                pass
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        prefill, decode = await _wait_idle(cluster)
        assert (decode.num_running, decode.num_free_blocks, prefill.num_free_blocks) == (0, 256, 256)


@pytest.mark.asyncio
async def test_colocated_worker_equals_transformers_and_moves_only_the_partial_block(
    llama_checkpoint: Path, start_cluster
) -> None:
    cluster = start_cluster(cluster_config(llama_checkpoint, colocated_workers=1))
    assert cluster.prefill_addresses == cluster.decode_addresses
    prompts = random_prompts(LENGTHS[:8], seed=52)
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = await asyncio.gather(
        *(generate(cluster.endpoint, generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params)) for p in prompts)
    )
    oracle = Oracle(llama_checkpoint)
    for prompt, responses in zip(prompts, results):
        assert _tokens(responses) == oracle.generate(prompt, MAX_TOKENS)
    report = await load(cluster.decode_addresses[0], "decode")
    assert report.role == "colocated"
    # The only engine on the machine: its OpenMP threads keep libgomp's wait policy (whatever the test's
    # environment says), not the PASSIVE that several engines sharing the cores get.
    assert _wait_policy_settings(cluster.process("colocated-0").pid) == _this_wait_policy()
    # Full prompt blocks come from the worker's own prefix cache; only partial last blocks travel.
    partial = sum(1 for p in prompts if len(p) % 16)
    assert report.kv_transfers == partial
    block_bytes = 3 * 2 * 16 * 2 * 16 * 4  # layers x (k, v) x block x kv heads x head dim x float32
    assert report.kv_bytes_received == partial * block_bytes
