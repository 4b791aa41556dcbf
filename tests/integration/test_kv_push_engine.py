"""KV pushed layer by layer while a prefill engine runs: the pieces add up to exactly the KV the lease holds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tests.conftest import random_prompts
from tests.support.handoff import HOLD

PUSH = dataclasses.replace(HOLD, push=True)


class RecordingSink:
    """A KVPushSink that assembles what it is handed, as a decode worker's inbox does."""

    def __init__(self) -> None:
        self.pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        self.ends: dict[str, bool] = {}

    def push_layer(self, request_id: str, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        self.pieces.setdefault(request_id, []).append((layer, first_block, blocks.clone()))

    def push_end(self, request_id: str, complete: bool) -> None:
        assert request_id not in self.ends, "push_end twice"
        self.ends[request_id] = complete

    def assemble(self, request_id: str, like: torch.Tensor) -> torch.Tensor:
        """The whole tensor from the pieces, later pieces over earlier ones; NaN where none came."""
        whole = torch.full_like(like, float("nan"))
        for layer, first_block, blocks in self.pieces[request_id]:
            whole[layer : layer + 1, :, first_block : first_block + blocks.shape[2]] = blocks
        return whole


def _engine(checkpoint: Path, num_kv_blocks: int = 64, max_num_batched_tokens: int = 2048) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(checkpoint), dtype="float32"),
        cache=CacheConfig(num_kv_blocks=num_kv_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
    ))


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_chunked_prefill_pushes_every_layer_of_every_block_equal_to_the_held_kv(llama_checkpoint: Path) -> None:
    # 40-token chunks over 16-token blocks: chunk ends fall inside blocks, and a prompt of 100
    # ends with a partial block; the 16-token prompt fits one chunk and one block exactly.
    engine = _engine(llama_checkpoint, max_num_batched_tokens=40)
    sink = RecordingSink()
    engine.kv_pusher.sink = sink
    prompts = random_prompts([100, 16, 33], seed=91)
    ids = [engine.add_request(p, SamplingParams(max_tokens=1), hold_kv=PUSH) for p in prompts]
    _run(engine)
    for request_id, prompt in zip(ids, prompts):
        held = engine.leases.export(request_id, 0)
        assert torch.equal(sink.assemble(request_id, held), held)
        assert sink.ends[request_id] is True
        # Pieces follow the chunks: every layer once per step that completed blocks, in layer order.
        layers = [layer for layer, _, _ in sink.pieces[request_id]]
        num_layers = held.shape[0]
        assert len(layers) % num_layers == 0
        assert layers == list(range(num_layers)) * (len(layers) // num_layers)
    # The 100-token prompt ran in chunks ending at 40, 80 (mid-block) and 100: blocks 0-1, 2-4, 5-6.
    firsts = sorted({(first, blocks.shape[2]) for _, first, blocks in sink.pieces[ids[0]]})
    assert firsts == [(0, 2), (2, 3), (5, 2)]


def test_requests_without_push_hand_nothing_to_the_sink_and_an_abort_ends_the_push(llama_checkpoint: Path) -> None:
    engine = _engine(llama_checkpoint, max_num_batched_tokens=32)
    sink = RecordingSink()
    engine.kv_pusher.sink = sink
    plain, pushed = random_prompts([50, 50], seed=92)
    plain_id = engine.add_request(plain, SamplingParams(max_tokens=1), hold_kv=HOLD)
    pushed_id = engine.add_request(pushed, SamplingParams(max_tokens=1), hold_kv=PUSH)
    engine.step()  # the pushed request's first chunk (or the plain one's): not finished yet
    while pushed_id not in sink.pieces:
        engine.step()
    engine.abort_request(pushed_id)
    _run(engine)
    assert plain_id not in sink.pieces and plain_id not in sink.ends
    assert sink.ends == {pushed_id: False}
    assert engine.leases.request_ids == [plain_id]
    engine.leases.release(plain_id)
    assert engine.block_manager.num_used_blocks == 0


def test_a_preempted_request_pushes_its_recomputed_blocks_again(llama_checkpoint: Path) -> None:
    # A decoding request grows into a pool too small for both: the pushing request, newer and
    # mid-prefill, is preempted (its blocks freed) and prefilled again later.
    engine = _engine(llama_checkpoint, num_kv_blocks=6, max_num_batched_tokens=3)
    sink = RecordingSink()
    engine.kv_pusher.sink = sink
    growing, pushed = random_prompts([15, 64], seed=93)
    growing_id = engine.add_request(growing, SamplingParams(max_tokens=60, ignore_eos=True))
    pushed_id = engine.add_request(pushed, SamplingParams(max_tokens=1), hold_kv=PUSH)
    while pushed_id not in engine.leases:
        engine.step()
    assert engine.scheduler.num_preemptions >= 1
    held = engine.leases.export(pushed_id, 0)
    assert torch.equal(sink.assemble(pushed_id, held), held)
    # Block 0 went out before the preemption and again after it.
    assert sum(1 for layer, first, _ in sink.pieces[pushed_id] if layer == 0 and first == 0) >= 2
    assert sink.ends == {pushed_id: True}
    assert growing_id not in sink.pieces
    engine.leases.release(pushed_id)
    _run(engine)
    assert engine.block_manager.num_used_blocks == 0


def test_blocks_before_push_first_block_are_never_pushed_and_the_last_block_always_is(llama_checkpoint: Path) -> None:
    engine = _engine(llama_checkpoint, max_num_batched_tokens=40)
    sink = RecordingSink()
    engine.kv_pusher.sink = sink
    # 100 tokens: blocks 0-6, the last partial. The receiver caches blocks 0-2; a second
    # request claims more than the prompt has: its last block still goes.
    skip3, skip_all = random_prompts([100, 100], seed=93)
    skip3_id = engine.add_request(skip3, SamplingParams(max_tokens=1),
                                  hold_kv=dataclasses.replace(PUSH, push_first_block=3))
    skip_all_id = engine.add_request(skip_all, SamplingParams(max_tokens=1),
                                     hold_kv=dataclasses.replace(PUSH, push_first_block=50))
    _run(engine)
    for request_id, first in ((skip3_id, 3), (skip_all_id, 6)):
        held = engine.leases.export(request_id, 0)
        pushed = sink.assemble(request_id, held)
        assert torch.equal(pushed[:, :, first:], held[:, :, first:])
        assert bool(pushed[:, :, :first].isnan().all())
        assert min(block for _, block, _ in sink.pieces[request_id]) == first
        assert sink.ends[request_id] is True
