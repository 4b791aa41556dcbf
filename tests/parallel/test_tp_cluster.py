"""A prefill worker at TP 2 and a decode worker at TP 3 behind the gateway, in one process (their ranks in others).

The decode service lands each handoff as a ``KVFetch``: rank 0's heads fetched by the
service, every other rank's by that rank from the prefill worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.service_common.server import ServerConfig
from tests.conftest import StartInProcessCluster, random_prompts
from tests.parallel.support import Reference, build
from tests.security.test_tls_and_auth import Pki, pki  # noqa: F401 - pki: the throwaway CA fixture
from tests.support.cluster import ClusterOptions
from tests.support.near_ties import comparable

MAX_TOKENS = 6


@pytest.mark.asyncio
@pytest.mark.parametrize("kv_transport", ["grpc", "torch_dist"])
async def test_gateway_serves_prefill_tp2_and_decode_tp3_workers_token_for_token(
    tmp_path: Path, start_inprocess_cluster: StartInProcessCluster, kv_transport: str
) -> None:
    checkpoint = build(tmp_path / "mha_bias", "mha_bias")
    cluster = await start_inprocess_cluster(
        checkpoint, ClusterOptions(num_kv_blocks=64, prefill_tp=2, decode_tp=3, kv_transport=kv_transport)
    )
    assert cluster.prefill.runtime.engine.tensor_parallel_size == 2
    reference = Reference(checkpoint)
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for prompt in random_prompts([6, 19], seed=23):
        responses = await cluster.generate(
            generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params), timeout_s=120
        )
        tokens = [t for r in responses for t in r.token_ids]
        expected, margins = reference.generate(prompt, MAX_TOKENS)
        n = comparable(expected, margins)
        assert tokens[:n] == expected[:n]
    loads = await cluster.wait_idle()
    # The decode worker received only rank 0's heads (2 of 6) itself; nothing was recomputed.
    assert loads[1].kv_recomputes == 0 and loads[1].kv_transfers == 2


@pytest.mark.asyncio
async def test_decode_worker_follower_ranks_fetch_over_the_workers_mutual_tls(
    tmp_path: Path, start_inprocess_cluster: StartInProcessCluster, pki: Pki  # noqa: F811 - the fixture
) -> None:
    # Workers accept only mutual-TLS callers: a follower rank fetching in plaintext (or without the
    # decode worker's client certificate) is refused, and its request would be recomputed.
    checkpoint = build(tmp_path / "mha_bias", "mha_bias")
    options = ClusterOptions(num_kv_blocks=64, decode_tp=2, worker_server=ServerConfig(tls=pki.server(True)),
                             gateway_server=ServerConfig(tls=pki.server()), client_tls=pki.client(with_cert=True))
    cluster = await start_inprocess_cluster(checkpoint, options)
    engine = cluster.decode.runtime.engine
    recomputed: list[str] = []
    recompute = engine.kv_connector.scheduler.recompute

    def record_recompute(request_id: str):  # noqa: ANN202
        recomputed.append(request_id)  # a follower rank's fetch failed (the load report does not count it)
        return recompute(request_id)

    engine.kv_connector.scheduler.recompute = record_recompute  # type: ignore[method-assign]
    reference = Reference(checkpoint)
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    (prompt,) = random_prompts([15], seed=31)
    responses = await cluster.generate(
        generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params), timeout_s=120
    )
    expected, margins = reference.generate(prompt, MAX_TOKENS)
    n = comparable(expected, margins)
    assert [t for r in responses for t in r.token_ids][:n] == expected[:n]
    loads = await cluster.wait_idle()
    assert recomputed == [] and loads[1].kv_recomputes == 0 and loads[1].kv_transfers == 1
