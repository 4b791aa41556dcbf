"""KV handoffs between engines of different tensor-parallel sizes, over every CPU transport.

A prefill engine at TP=P holds each prompt's KV and serves it through the real
``KVSenderServicer`` (gRPC server on a loopback port); a decode engine at TP=D
lands it with each rank fetching exactly the KV heads it owns
(``kv_transfer.sharded``): rank 0's part here, the other ranks' in their own
processes when the KV lands. Greedy float32 decoding afterwards must give
transformers' tokens (tie rule: tests/parallel/support.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.engine.kv.handoff import KVFetch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pdserve.engine.types.handoff import KVHoldParams
from pdserve.engine.types.sampling_params import SamplingParams
from pdserve.kv_transfer.base import make_receiver
from pdserve.kv_transfer.config import INTERNAL_GRPC_OPTIONS, TransferConfig
from pdserve.kv_transfer.sender import KVSenderServicer
from pdserve.kv_transfer.sharded import RankFetchOptions, rank_fetcher
from pdserve.protos.pdserve.v1.internal import worker_pb2_grpc
from pdserve.service_common.security import TlsConfig, open_channel, server_credentials
from tests.conftest import random_prompts
from tests.parallel.support import Reference, build
from tests.security.test_tls_and_auth import Pki, pki  # noqa: F401 - pki: the throwaway CA fixture
from tests.support.handoff import finished_outputs
from tests.support.near_ties import comparable

TRANSPORTS = ("grpc", "shm", "torch_dist")
MAX_TOKENS = 6


def _engine(path: Path, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_kv_blocks=64),
        parallel=ParallelConfig(tensor_parallel_size=tp),
    ))


class _Servicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, kv: KVSenderServicer) -> None:
        self.FetchKV = kv.FetchKV  # noqa: N815 - the gRPC method names
        self.StageKV = kv.StageKV  # noqa: N815


class SenderServer:
    """The prefill engine's held KV behind a real gRPC server, on an event loop thread of its own.

    ``tls``: the server's TLS (None: plaintext); ``client_tls``: that of ``stub``, the
    channel the decode worker's rank 0 fetches over."""

    def __init__(self, engine: LLMEngine, tls: TlsConfig | None = None, client_tls: TlsConfig | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.kv = KVSenderServicer(engine.leases, TransferConfig(shm_prefix="pdserve_tp_test_"))
        self.server, port = self.run(self._start(tls))
        self.address = f"127.0.0.1:{port}"
        self.stub = worker_pb2_grpc.PrefillWorkerStub(self.run(self._channel(client_tls)))
        self.receivers = {name: make_receiver(name) for name in TRANSPORTS}

    def run(self, coroutine):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    async def _start(self, tls: TlsConfig | None) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=list(INTERNAL_GRPC_OPTIONS))
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_Servicer(self.kv), server)
        if tls is None:
            port = server.add_insecure_port("127.0.0.1:0")
        else:
            port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
        await server.start()
        return server, port

    async def _channel(self, tls: TlsConfig | None) -> grpc.aio.Channel:
        self.channel = open_channel(self.address, tls, INTERNAL_GRPC_OPTIONS)
        return self.channel

    def stop(self) -> None:
        async def stop() -> None:
            for receiver in self.receivers.values():
                await receiver.close()
            await self.channel.close()
            await self.server.stop(None)

        try:
            self.run(stop())
            self.kv.close()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # MHA, 6 KV heads: 3 per rank at TP 2, 2 per rank at TP 3 (decode rank 1's heads 2-3 come from both prefill ranks).
    return build(tmp_path_factory.mktemp("mha_bias"), "mha_bias")


@contextlib.contextmanager
def _prefill_and_decode(
    path: Path, prefill_tp: int, decode_tp: int
) -> Iterator[tuple[LLMEngine, LLMEngine, SenderServer]]:
    """A prefill engine behind its sender server and a decode engine, stopped (ranks included) however it ends."""
    prefill = decode = sender = None
    try:
        prefill = _engine(path, prefill_tp)
        decode = _engine(path, decode_tp)
        sender = SenderServer(prefill)
        yield prefill, decode, sender
    finally:
        if sender is not None:
            sender.stop()
        for engine in (decode, prefill):
            if engine is not None:
                engine.shutdown()


@pytest.fixture
def engines(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[tuple[LLMEngine, LLMEngine, SenderServer]]:
    with _prefill_and_decode(checkpoint, *request.param) as engines:
        yield engines


def _hand_over(prefill: LLMEngine, decode: LLMEngine, sender: SenderServer, prompt: list[int],
               params: SamplingParams, transport: str, options: RankFetchOptions | None = None,
               kv_heads: int = 6) -> str:
    """Hand ``prompt`` from ``prefill`` to ``decode``; the follower ranks fetch with ``options``. ``kv_heads``:
    the model's (the module checkpoint's 6)."""
    hold = KVHoldParams(transport=transport, address=sender.address, worker_id="prefill-tp", epoch=1)
    request_id = prefill.add_request(prompt, dataclasses.replace(params, max_tokens=1), hold_kv=hold)
    held = None
    while held is None:
        held = next((o for o in prefill.step() if o.request_id == request_id and o.finished), None)
    handoff = held.kv_handoff
    assert handoff is not None and handoff.tensor_parallel_size == prefill.tensor_parallel_size
    assert handoff.layout.num_kv_heads == kv_heads
    decode_id = decode.kv_connector.add_remote_request(request_id, prompt, params, handoff)
    (slot,) = decode.kv_connector.drain_kv_slots()
    heads = decode.local_kv_heads if decode.tensor_parallel_size > 1 else None
    # Rank 0's heads only (all of them at D=1); the other ranks fetch theirs as the KV lands.
    blocks = sender.run(sender.receivers[transport].fetch(handoff, slot.first_block, sender.stub, heads))
    assert blocks.shape[4] == (kv_heads if heads is None else len(heads))
    landed = decode.kv_connector.fill(
        decode_id, slot.first_block,
        blocks if heads is None else KVFetch(handoff, blocks, rank_fetcher(options or RankFetchOptions())),
    )
    assert landed is not None and landed.token_ids == [handoff.first_token_id]
    assert prefill.leases.release(request_id)
    return decode_id


@pytest.mark.parametrize("engines", [(2, 1), (1, 2), (2, 3)], indirect=True, ids=["P2-D1", "P1-D2", "P2-D3"])
def test_handoff_reshards_kv_between_tensor_parallel_sizes_over_every_cpu_transport(
    engines: tuple[LLMEngine, LLMEngine, SenderServer], checkpoint: Path
) -> None:
    prefill, decode, sender = engines

    def recompute(request_id: str) -> None:
        pytest.fail(f"a rank could not fetch its KV heads of {request_id}: recomputed instead")

    decode.kv_connector.scheduler.recompute = recompute  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    prompts = random_prompts([7, 13, 18], seed=prefill.tensor_parallel_size * 10 + decode.tensor_parallel_size)
    jobs = {}
    for i, transport in enumerate(TRANSPORTS):
        prompt = prompts[i]
        jobs[_hand_over(prefill, decode, sender, prompt, params, transport)] = prompt
    outputs = finished_outputs(decode)
    assert decode.block_manager.num_used_blocks == 0 and prefill.block_manager.num_used_blocks == 0
    reference = Reference(checkpoint)
    cut = 0
    for request_id, prompt in jobs.items():
        expected, margins = reference.generate(prompt, MAX_TOKENS)
        n = comparable(expected, margins)
        cut += n < len(expected)
        assert outputs[request_id][:n] == expected[:n], (request_id, outputs[request_id], expected)
    assert cut <= 1


@pytest.mark.parametrize("engines", [(1, 2)], indirect=True, ids=["P1-D2"])
def test_follower_ranks_fetch_their_kv_heads_over_mutual_tls_and_never_in_plaintext(
    engines: tuple[LLMEngine, LLMEngine, SenderServer], checkpoint: Path, pki: Pki  # noqa: F811 - the fixture
) -> None:
    prefill, decode, plaintext_sender = engines
    recomputed: list[str] = []
    recompute = decode.kv_connector.scheduler.recompute

    def record_recompute(request_id: str):  # noqa: ANN202
        recomputed.append(request_id)
        return recompute(request_id)

    decode.kv_connector.scheduler.recompute = record_recompute  # type: ignore[method-assign]
    client_tls = pki.client(with_cert=True)
    # The prefill worker accepts only mutual-TLS callers: a follower rank's plaintext channel is refused.
    tls_sender = SenderServer(prefill, tls=pki.server(require_client_cert=True), client_tls=client_tls)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        prompts = random_prompts([9, 14, 11, 16], seed=41)
        tls_options = RankFetchOptions(TransferConfig(rpc_timeout_s=10.0), client_tls)
        plaintext_options = RankFetchOptions(TransferConfig(rpc_timeout_s=10.0), None)
        # Every follower fetch over TLS (grpc carries the KV; shm's staging call crosses the same channel).
        landed, outputs = {}, {}
        for transport, prompt in (("grpc", prompts[0]), ("shm", prompts[1])):
            landed[_hand_over(prefill, decode, tls_sender, prompt, params, transport, tls_options)] = prompt
            assert recomputed == [], f"a follower rank could not fetch its heads over TLS ({transport})"
            outputs.update(finished_outputs(decode))
        # A follower without TLS is refused by the TLS worker; one with TLS does not fall back to plaintext
        # against a plaintext-only worker. Either way the prompt is recomputed here, never served half-landed.
        refused = {}
        for sender, options, prompt in ((tls_sender, plaintext_options, prompts[2]),
                                        (plaintext_sender, tls_options, prompts[3])):
            refused[_hand_over(prefill, decode, sender, prompt, params, "grpc", options)] = prompt
            outputs.update(finished_outputs(decode))
        assert recomputed == list(refused)
    finally:
        tls_sender.stop()
    assert decode.block_manager.num_used_blocks == 0 and prefill.block_manager.num_used_blocks == 0
    reference = Reference(checkpoint)
    for request_id, prompt in {**landed, **refused}.items():
        expected, margins = reference.generate(prompt, MAX_TOKENS)
        n = comparable(expected, margins)
        assert outputs[request_id][:n] == expected[:n], (request_id, outputs[request_id], expected)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_latent_attention_kv_lands_between_tensor_parallel_sizes(
    tmp_path: Path, prefill_tp: int, decode_tp: int
) -> None:
    # DeepSeek-V3's latent rows: one KV head, which every rank holds whole (replicated), one part per token.
    path = build(tmp_path, "deepseek_v3")
    with _prefill_and_decode(path, prefill_tp, decode_tp) as (prefill, decode, sender):
        assert (prefill.kv_layout.kv_parts, prefill.kv_layout.num_kv_heads) == (1, 1)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        prompts = random_prompts([9, 17], seed=40 + prefill_tp)
        jobs = {_hand_over(prefill, decode, sender, prompt, params, transport, kv_heads=1): prompt
                for prompt, transport in zip(prompts, ("grpc", "shm"))}
        outputs = finished_outputs(decode)
        assert decode.block_manager.num_used_blocks == 0 and prefill.block_manager.num_used_blocks == 0
    reference = Reference(path)
    for request_id, prompt in jobs.items():
        expected, margins = reference.generate(prompt, MAX_TOKENS)
        n = comparable(expected, margins)
        assert outputs[request_id][:n] == expected[:n], (request_id, outputs[request_id], expected)
