"""Tensor parallelism on GPUs: NCCL all-reduces, and the re-sharding handoff over cuda_ipc and torch_dist (NCCL).

Marked ``gpu``; skipped without at least 2 CUDA devices (the prefill and the decode
engine at TP 2 share GPUs 0 and 1). Runs only where two CUDA devices are present (scripts/gpu_checks.sh).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.handoff import KVFetch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pdserve.engine.types.handoff import KVHoldParams
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.sharded import RankFetchOptions, rank_fetcher
from tests.conftest import random_prompts
from tests.parallel.support import Reference, build
from tests.support.near_ties import comparable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("mha_bias"), "mha_bias")


def test_nccl_tensor_parallel_float32_equals_transformers(checkpoint: Path) -> None:
    reference = Reference(checkpoint)
    prompts = random_prompts([3, 17, 40], seed=61)
    with LLM(str(checkpoint), dtype="float32", device="cuda:0", block_size=4, num_kv_blocks=128,
             attention_backend="sdpa", tensor_parallel_size=2) as llm:
        assert llm.engine.parallel.backend == "nccl"
        outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for prompt, out in zip(prompts, outputs):
        expected, margins = reference.generate(prompt, MAX_TOKENS)
        n = comparable(expected, margins)
        assert out.token_ids[:n] == expected[:n]


def _engine(path: Path, tp: int, device: str) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", device=device, attention_backend="sdpa"),
        cache=CacheConfig(block_size=4, num_kv_blocks=64),
        parallel=ParallelConfig(tensor_parallel_size=tp),
    ))


@pytest.mark.parametrize(("transport", "backend"), [("cuda_ipc", "gloo"), ("torch_dist", "nccl")])
def test_handoff_from_tp2_to_tp2_reshards_over_gpu_transports(checkpoint: Path, transport: str, backend: str) -> None:
    from tests.parallel.test_tp_handoff import SenderServer

    prefill = _engine(checkpoint, 2, "cuda:0")
    decode = _engine(checkpoint, 2, "cuda:0")
    sender = None
    config = TransferConfig(torch_dist_backend=backend, device="cuda:0")
    try:
        sender = SenderServer(prefill)
        sender.kv.config = config
        from pdserve.kv_transfer.base import make_receiver

        receiver = make_receiver(transport, config)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        prompt = random_prompts([21], seed=62)[0]
        hold = KVHoldParams(transport=transport, address=sender.address, worker_id="p", epoch=1)
        request_id = prefill.add_request(prompt, dataclasses.replace(params, max_tokens=1), hold_kv=hold)
        held = None
        while held is None:
            held = next((o for o in prefill.step() if o.finished), None)
        decode_id = decode.kv_connector.add_remote_request(request_id, prompt, params, held.kv_handoff)
        (slot,) = decode.kv_connector.drain_kv_slots()
        blocks = sender.run(receiver.fetch(held.kv_handoff, slot.first_block, sender.stub, decode.local_kv_heads))
        assert decode.kv_connector.fill(decode_id, slot.first_block, KVFetch(held.kv_handoff, blocks, rank_fetcher(RankFetchOptions(config))))
        prefill.leases.release(request_id)
        tokens = None
        while decode.has_unfinished_requests():
            for out in decode.step():
                if out.finished:
                    tokens = out.token_ids
        expected, margins = Reference(checkpoint).generate(prompt, MAX_TOKENS)
        n = comparable(expected, margins)
        assert tokens[:n] == expected[:n]
    finally:
        if sender is not None:
            sender.stop()
        decode.shutdown()
        prefill.shutdown()
