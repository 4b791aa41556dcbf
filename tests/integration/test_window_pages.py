"""KV pages behind sliding windows through whole engines: what a sequence holds, what a handoff carries,
and an engine that keeps every block meeting KV from one that does not; every output against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.pages import NO_PAGE, PagedBlockManager
from tests.conftest import Oracle, random_prompts
from tests.support.handoff import finished_outputs, handoff_tokens, prefill_and_hold

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
BS = 16
# The tiny Gemma 3 (window 40; layers sliding, sliding, full, sliding) and Mistral (window 48, all sliding).
SLIDING = ["gemma3", "mistral"]


@pytest.fixture(params=SLIDING)
def sliding_checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_checkpoint")


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=BS, **kwargs)


def _generate_checking_pages(engine: object, prompt: list[int]) -> list[int]:
    """Generate from ``prompt``, asserting after every step what the sequence's blocks hold: every block in
    the full groups, and in the sliding ones the blocks from its next query's window on (every block where the
    engine keeps them all)."""
    manager = engine.block_manager  # type: ignore[attr-defined]
    request_id = engine.add_request(prompt, GREEDY)  # type: ignore[attr-defined]
    seq = engine._requests[request_id]  # type: ignore[attr-defined]
    tokens: list[int] = []
    while not seq.is_finished:
        for out in engine.step():  # type: ignore[attr-defined]
            tokens = out.token_ids
        blocks = len(seq.block_table)
        if seq.is_finished:
            break
        if isinstance(manager, PagedBlockManager):
            groups, sliding = manager.layout.num_groups, manager.layout.num_sliding_groups
            first = max(0, seq.num_computed_tokens - manager.layout.window + 1) // BS
            assert manager.num_pages_held(seq) == blocks * (groups - sliding) + (blocks - first) * sliding
        else:
            assert manager.num_used_blocks == blocks
    assert manager.held_block_ids() == []
    return tokens


def test_a_sequence_keeps_only_its_window_in_the_sliding_layers(sliding_checkpoint: Path) -> None:
    prompt = random_prompts([150], seed=40)[0]
    expected = Oracle(sliding_checkpoint).generate(prompt, MAX_TOKENS)
    paged = _llm(sliding_checkpoint, num_kv_blocks=32, enable_prefix_caching=False).engine
    assert isinstance(paged.block_manager, PagedBlockManager)
    assert _generate_checking_pages(paged, prompt) == expected
    assert paged.block_manager.num_free_pages == paged.block_manager.num_pages
    full = _llm(sliding_checkpoint, num_kv_blocks=32, disable_hybrid_kv_cache_manager=True).engine
    assert not isinstance(full.block_manager, PagedBlockManager)
    assert _generate_checking_pages(full, prompt) == expected


def test_a_handoff_carries_zeros_where_the_window_freed_pages_and_the_decoder_gives_them_none(
    sliding_checkpoint: Path,
) -> None:
    prompt = random_prompts([150], seed=41)[0]
    # Without prefix caching the prefill engine frees the pages its window passed at once.
    prefill = _llm(sliding_checkpoint, num_kv_blocks=32, enable_prefix_caching=False).engine
    decode = _llm(sliding_checkpoint, num_kv_blocks=32).engine
    held = prefill_and_hold(prefill, prompt, GREEDY)
    assert held.kv_handoff is not None
    blocks = prefill.leases.export(held.request_id, 0)
    layout = prefill.block_manager.layout
    first = (len(prompt) - layout.window + 1) // BS
    sliding_layers = {layer for group, layers in enumerate(layout.groups) if layout.sliding[group] for layer in layers}
    for layer in range(blocks.shape[0]):
        zero = [bool((blocks[layer, :, index] == 0).all()) for index in range(blocks.shape[2])]
        assert zero == [layer in sliding_layers and index < first for index in range(blocks.shape[2])]
    # The decode engine gives those blocks no sliding page, and continues exactly.
    request_id = decode.kv_connector.add_remote_request(held.request_id, prompt, GREEDY, held.kv_handoff)
    (slot,) = decode.kv_connector.drain_kv_slots()
    assert decode.kv_connector.fill(request_id, slot.first_block, blocks) is not None
    assert prefill.leases.release(request_id)
    manager = decode.block_manager
    seq = decode._requests[request_id]
    sliding_groups = [group for group in range(layout.num_groups) if layout.sliding[group]]
    pages = manager.pages[seq.block_table][:, sliding_groups]
    assert [bool((row == NO_PAGE).all()) for row in pages] == [index < first for index in range(len(pages))]
    outputs = finished_outputs(decode)
    assert outputs[request_id] == Oracle(sliding_checkpoint).generate(prompt, MAX_TOKENS)
    assert manager.held_block_ids() == []


def test_an_engine_keeping_every_block_does_not_cache_imported_blocks_the_window_passed(
    sliding_checkpoint: Path,
) -> None:
    """Their sliding layers may hold the zeros a paged engine sent: a prefix hit on them would read zeros."""
    prompt = random_prompts([150], seed=42)[0]
    prefill = _llm(sliding_checkpoint, num_kv_blocks=32, enable_prefix_caching=False).engine
    decode = _llm(sliding_checkpoint, num_kv_blocks=32, disable_hybrid_kv_cache_manager=True).engine
    oracle = Oracle(sliding_checkpoint)
    (tokens,) = handoff_tokens(prefill, decode, [prompt], GREEDY).values()
    assert tokens == oracle.generate(prompt, MAX_TOKENS)
    # None of the imported blocks is cached: the window had passed blocks 0-5 of the 150-token prompt.
    assert decode.block_manager.num_cached_blocks == 0
    # A prompt sharing the first 64 tokens: a hit of 4 blocks would read blocks 1-3 in the sliding layers.
    again = prompt[:64] + random_prompts([20], seed=43)[0]
    request_id = decode.add_request(again, GREEDY)
    final = None
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                final = out
    assert final is not None and final.request_id == request_id and final.num_cached_tokens == 0
    assert final.token_ids == oracle.generate(again, MAX_TOKENS)


def test_where_every_layer_slides_a_prefix_hit_survives_its_first_blocks_being_reclaimed(
    mistral_checkpoint: Path,
) -> None:
    """vLLM's sliding-window lookup: only the blocks the next query's window reads must still be cached."""
    oracle = Oracle(mistral_checkpoint)
    llm = _llm(mistral_checkpoint, num_kv_blocks=12)  # window 48: 12 pages of 16 positions, one group
    prompt = random_prompts([150], seed=44)[0]
    first = llm.generate([prompt], GREEDY)[0]
    assert first.token_ids == oracle.generate(prompt, MAX_TOKENS)
    manager = llm.engine.block_manager
    # 161 positions computed: 10 full blocks cached (pages reclaimable), the partial 11th's page free.
    assert isinstance(manager, PagedBlockManager)
    assert (manager.num_reclaimable_pages, manager.num_free_pages) == (10, 2)
    # An unrelated prompt takes back the pages let go first: those of the prompt's first blocks.
    other = random_prompts([80], seed=45)[0]
    assert llm.generate([other], GREEDY)[0].token_ids == oracle.generate(other, MAX_TOKENS)
    hashes = llm.engine.add_request(prompt + [5], SamplingParams(max_tokens=1))  # its hashes, then aborted
    seq = llm.engine._requests[hashes]
    cached = [manager.cached_block_id(block_hash) is not None for block_hash in seq.block_hashes()[:9]]
    llm.engine.abort_request(hashes)
    assert cached == [False] * 4 + [True] * 5  # 6 blocks for 92 positions: the 2 free pages, then 4 reclaimed
    # The prompt again, extended: the next query (position 144) reads positions 97.. , blocks 6-8, still there.
    again = prompt + random_prompts([10], seed=46)[0]
    out = llm.generate([again], GREEDY)[0]
    assert out.num_cached_tokens == 144
    assert out.token_ids == oracle.generate(again, MAX_TOKENS)
    assert manager.held_block_ids() == []
