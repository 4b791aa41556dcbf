"""KV pages behind sliding windows under tensor parallelism: every rank's pool paged alike, rank 0 keeping the
page table and sending each step in pages and each export or import with its blocks' pages; greedy float32
output against transformers (tie rule: tests/parallel/support.py), the KV a handoff carries, and what the
decode side gives its blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.attention.backend import AttentionBatch
from pdserve.engine.kv.pages import NO_PAGE, PagedBlockManager
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parallel.step_codec import StepInputs, decode_step, encode_step
from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pdserve.engine.types.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.parallel.support import Reference, build
from tests.parallel.test_tp_handoff import SenderServer, _hand_over
from tests.support.handoff import finished_outputs, prefill_and_hold
from tests.support.near_ties import comparable

BS = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_a_paged_step_carries_each_groups_tables_and_slots_to_the_other_ranks() -> None:
    cpu = torch.device("cpu")
    common = dict(num_decodes=1, query_lens=[1, 3], context_lens=[6, 3], block_size=4, device=cpu, num_heads=6,
                  num_kv_heads=6)
    logical = AttentionBatch(block_tables=[[4, 9], [2]], slot_mapping=torch.tensor([37, 8, 9, 10]), **common)
    full = AttentionBatch(block_tables=[[0, 5], [7]], slot_mapping=torch.tensor([21, 28, 29, 30]), **common)
    sliding = AttentionBatch(block_tables=[[0, 3], [1]], slot_mapping=torch.tensor([13, 4, 5, 6]), **common)
    batch = AttentionBatch(block_tables=logical.block_tables, slot_mapping=logical.slot_mapping,
                           groups=(full, sliding), layer_groups=(1, 0, 1), **common)
    inputs = StepInputs(torch.tensor([11, 12, 13, 14]), torch.tensor([5, 0, 1, 2]), batch, torch.tensor([0, 3]))
    header, payload = encode_step(inputs)
    assert header[7].item() == 2
    decoded = decode_step(header, payload, 4, 3, 3, cpu, layer_groups=(1, 0, 1))
    assert decoded.batch.block_tables == [[4, 9], [2]] and decoded.batch.slot_mapping.tolist() == [37, 8, 9, 10]
    assert decoded.batch.layer_groups == (1, 0, 1)
    assert [group.block_tables for group in decoded.batch.groups] == [[[0, 5], [7]], [[0, 3], [1]]]
    assert [group.slot_mapping.tolist() for group in decoded.batch.groups] == [[21, 28, 29, 30], [13, 4, 5, 6]]
    assert [group.num_heads for group in decoded.batch.groups] == [3, 3]
    assert decoded.logits_rows.tolist() == [0, 3] and decoded.input_ids.tolist() == [11, 12, 13, 14]
    # A rank whose pool is not paged (or paged otherwise) refuses the step rather than read the wrong pages.
    with pytest.raises(RuntimeError, match="a step for 2 KV page groups reached a rank whose pool has 0"):
        decode_step(header, payload, 4, 3, 3, cpu)


def _engine(path: Path, tp: int, num_kv_blocks: int, prefix_caching: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=BS, num_kv_blocks=num_kv_blocks, enable_prefix_caching=prefix_caching),
        parallel=ParallelConfig(tensor_parallel_size=tp),
    ))


def _check(reference: Reference, prompt: list[int], output: list[int]) -> None:
    expected, margins = reference.generate(prompt, MAX_TOKENS)
    n = comparable(expected, margins)
    assert output[:n] == expected[:n], (output, expected, n)


@pytest.fixture(scope="module", params=["mistral", "gemma2"])
def sliding(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Reference]:
    # Window 10 (4 positions a block): Mistral's 2 layers both slide (2 KV heads, one a rank); Gemma 2's
    # alternate sliding and full.
    path = build(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, Reference(path)


def test_every_rank_keeps_only_the_window_and_reads_the_pages_rank_0_gives(
    sliding: tuple[str, Path, Reference],
) -> None:
    name, path, reference = sliding
    prompts = random_prompts([30, 41, 26], seed=50)
    # Pages of 16 blocks (Mistral: one group) or 24 (Gemma 2: two) for three sequences needing 9 + 12 + 8
    # blocks: only freed pages let them run side by side, each reusing pages the others' windows let go.
    num_kv_blocks = {"mistral": 16, "gemma2": 24}[name]
    engine = _engine(path, 2, num_kv_blocks=num_kv_blocks, prefix_caching=False)
    try:
        manager = engine.block_manager
        assert isinstance(manager, PagedBlockManager) and engine.kv_cache.layout is not None
        ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
        seqs = [engine._requests[request_id] for request_id in ids]
        outputs: dict[str, list[int]] = {}
        reused = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.token_ids
            held = [seq for seq in seqs if not seq.is_finished]
            layout = manager.layout
            for seq in held:
                blocks = len(seq.block_table)
                first = max(0, seq.num_computed_tokens - layout.window + 1) // BS
                full, windowed = layout.num_groups - layout.num_sliding_groups, layout.num_sliding_groups
                assert manager.num_pages_held(seq) == blocks * full + (blocks - first) * windowed
            reused = reused or max((id for seq in held for id in seq.block_table), default=0) >= num_kv_blocks
        assert reused, "no logical block id reached past the pool's blocks: the test did not page"
        assert manager.held_block_ids() == [] and manager.num_free_pages == manager.num_pages
    finally:
        engine.shutdown()
    for request_id, prompt in zip(ids, prompts):
        _check(reference, prompt, outputs[request_id])


def test_a_paged_handoff_between_tensor_parallel_engines_carries_zeros_where_windows_freed_pages(
    sliding: tuple[str, Path, Reference],
) -> None:
    _, path, reference = sliding
    prompt = random_prompts([37], seed=51)[0]
    prefill = decode = sender = None
    try:
        prefill = _engine(path, 2, num_kv_blocks=32, prefix_caching=False)
        decode = _engine(path, 2, num_kv_blocks=32)
        sender = SenderServer(prefill)
        layout = prefill.block_manager.layout
        # Rank 0's export of every head (its own and rank 1's, sent with the blocks' pages): zeros in the
        # sliding layers of the blocks the window passed.
        held = prefill_and_hold(prefill, prompt, GREEDY)
        blocks = prefill.leases.export(held.request_id, 0)
        assert blocks.shape[4] == prefill.kv_layout.num_kv_heads
        first = (len(prompt) - layout.window + 1) // BS
        sliding_layers = {
            layer for group, layers in enumerate(layout.groups) if layout.sliding[group] for layer in layers
        }
        for layer in range(blocks.shape[0]):
            zero = [bool((blocks[layer, :, index] == 0).all()) for index in range(blocks.shape[2])]
            assert zero == [layer in sliding_layers and index < first for index in range(blocks.shape[2])]
        assert prefill.leases.release(held.request_id)
        # Handed over as a decode worker lands it (each decode rank fetching its own heads into the pages
        # rank 0 names): no sliding page for the blocks before the window, and the output exact.
        decode_id = _hand_over(prefill, decode, sender, prompt, GREEDY, "grpc",
                               kv_heads=prefill.kv_layout.num_kv_heads)
        seq = decode._requests[decode_id]
        sliding_groups = [group for group in range(layout.num_groups) if layout.sliding[group]]
        pages = decode.block_manager.pages[seq.block_table][:, sliding_groups]
        assert [bool((row == NO_PAGE).all()) for row in pages] == [index < first for index in range(len(pages))]
        outputs = finished_outputs(decode)
        assert decode.block_manager.held_block_ids() == [] and prefill.block_manager.held_block_ids() == []
    finally:
        if sender is not None:
            sender.stop()
        for engine in (decode, prefill):
            if engine is not None:
                engine.shutdown()
    _check(reference, prompt, outputs[decode_id])
