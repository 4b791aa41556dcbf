"""A request whose KV comes from another engine: a scheduler state (WAITING_FOR_REMOTE_KVS), on real engines.

Blocks are allocated before the KV moves, the request is not scheduled until it
lands, an abort frees the blocks like any other, KV that lands after an abort is
dropped, and the handoff's block hashes are computed once, by the prefill side.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

import pdserve.engine.sequence
import pdserve.engine.types.hashing
from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.types.handoff import KVSlot
from tests.conftest import Oracle, random_prompts
from tests.support.handoff import handoff_tokens, prefill_and_hold

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT = random_prompts([37], seed=61)[0]  # 2 full blocks of 16 and a partial one: 3 blocks


def _engine(path: Path) -> LLMEngine:
    return LLM(model=str(path), dtype="float32", num_kv_blocks=32).engine


@pytest.fixture(scope="module")
def oracle_llama(llama_checkpoint: Path) -> Oracle:
    return Oracle(llama_checkpoint)


def test_abort_while_waiting_for_remote_kv_frees_its_blocks(llama_checkpoint: Path) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    held = prefill_and_hold(prefill, PROMPT, GREEDY)
    assert held.kv_handoff is not None
    decode.kv_connector.add_remote_request("r", PROMPT, GREEDY, held.kv_handoff)
    assert decode.kv_connector.drain_kv_slots() == [KVSlot("r", 0)]
    assert decode.block_manager.num_used_blocks == 3
    # Not schedulable until its KV lands: a step does nothing, and nothing is left to step.
    assert not decode.has_work() and decode.step() == []
    # It counts as running load all the same: its blocks are taken and it runs as soon as the KV lands.
    assert (decode.stats().num_running, decode.stats().num_waiting) == (1, 0)
    aborted = decode.abort_request("r")
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.token_ids == held.token_ids
    assert decode.block_manager.num_used_blocks == 0 and not decode.has_unfinished_requests()


def test_kv_that_lands_after_an_abort_is_dropped(llama_checkpoint: Path) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    held = prefill_and_hold(prefill, PROMPT, GREEDY)
    assert held.kv_handoff is not None
    decode.kv_connector.add_remote_request("r", PROMPT, GREEDY, held.kv_handoff)
    (slot,) = decode.kv_connector.drain_kv_slots()
    blocks = prefill.leases.export(held.request_id, slot.first_block)
    decode.abort_request("r")
    assert decode.kv_connector.fill("r", slot.first_block, blocks) is None
    assert decode.kv_connector.scheduler.recompute("r") is None
    assert decode.block_manager.num_used_blocks == 0 and decode.block_manager.num_cached_blocks == 0
    assert not decode.has_unfinished_requests() and decode.step() == []


def test_block_hashes_are_computed_once_per_handoff(
    llama_checkpoint: Path, oracle_llama: Oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    hashed: list[list[int]] = []
    for module in (pdserve.engine.sequence, pdserve.engine.types.hashing):  # the engine's sequences, and hash_prompt_blocks

        def counting(parent, token_ids, model_id, real=module.hash_block):  # noqa: ANN001, ANN202
            hashed.append(list(token_ids))
            return real(parent, token_ids, model_id)

        monkeypatch.setattr(module, "hash_block", counting)
    # 37 prompt tokens + 8 generated stay under 48: no block fills after the prompt's two.
    outputs = handoff_tokens(prefill, decode, [PROMPT], GREEDY)
    assert outputs == {"req-0": oracle_llama.generate(PROMPT, MAX_TOKENS)}
    # Each full prompt block hashed once, on the prefill side; the decode side took the handoff's hashes.
    assert hashed == [PROMPT[:16], PROMPT[16:32]]
    assert decode.block_manager.num_cached_blocks == 2


async def _collect(stream) -> list[int]:  # noqa: ANN001
    tokens: list[int] = []
    async for output in stream:
        tokens = output.token_ids
    return tokens


@pytest.mark.asyncio
async def test_async_import_fetches_into_allocated_blocks_or_recomputes(
    llama_checkpoint: Path, oracle_llama: Oracle
) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    async_engine = AsyncEngine(decode)
    async_engine.start()
    try:
        asked: list[tuple[str, int]] = []
        for request_id, lost in (("fetched", False), ("recomputed", True)):
            held = prefill_and_hold(prefill, PROMPT, GREEDY)
            assert held.kv_handoff is not None

            async def receive_kv(first_block: int, held=held, lost=lost, request_id=request_id) -> torch.Tensor | None:
                asked.append((request_id, first_block))
                return None if lost else prefill.leases.export(held.request_id, first_block)

            stream = async_engine.import_request(request_id, PROMPT, GREEDY, held.kv_handoff, receive_kv)
            assert await _collect(stream) == oracle_llama.generate(PROMPT, MAX_TOKENS)
            prefill.leases.release(held.request_id)
        # The second request found the first one's prompt blocks cached: only the partial block was asked for.
        assert asked == [("fetched", 0), ("recomputed", 2)]
        assert await async_engine.call(lambda e: e.block_manager.num_used_blocks) == 0
    finally:
        await async_engine.stop()


@pytest.mark.asyncio
async def test_cancel_while_the_kv_is_on_its_way_frees_the_blocks(llama_checkpoint: Path) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    held = prefill_and_hold(prefill, PROMPT, GREEDY)
    assert held.kv_handoff is not None
    async_engine = AsyncEngine(decode)
    async_engine.start()
    try:
        asked, never = asyncio.Event(), asyncio.Event()

        async def receive_kv(first_block: int) -> torch.Tensor:
            asked.set()
            await never.wait()  # the transfer is still running when the client goes away
            raise AssertionError("unreachable")

        task = asyncio.create_task(
            _collect(async_engine.import_request("r", PROMPT, GREEDY, held.kv_handoff, receive_kv))
        )
        await asyncio.wait_for(asked.wait(), timeout=30)
        state = await async_engine.call(lambda e: (e.block_manager.num_used_blocks, list(e.scheduler.receiving)))
        assert state == (3, ["r"])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        state = await async_engine.call(lambda e: (e.block_manager.num_used_blocks, e.has_unfinished_requests()))
        assert state == (0, False)
    finally:
        await async_engine.stop()


def test_a_remote_request_whose_blocks_are_all_here_lands_as_they_are_allocated(
    llama_checkpoint: Path, oracle_llama: Oracle
) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    prompt = random_prompts([32], seed=62)[0]  # two full blocks: both cacheable
    assert handoff_tokens(prefill, decode, [prompt], GREEDY) == {"req-0": oracle_llama.generate(prompt, MAX_TOKENS)}
    held = prefill_and_hold(prefill, prompt, GREEDY)
    assert held.kv_handoff is not None
    decode.kv_connector.add_remote_request("again", prompt, GREEDY, held.kv_handoff)
    (slot,) = decode.kv_connector.drain_kv_slots()
    assert slot == KVSlot("again", 2)  # both blocks found in the decode engine's prefix cache: nothing to copy
    landed = decode.kv_connector.join_if_present(slot)
    assert landed is not None and landed.token_ids == held.token_ids and not landed.finished
    # Running already: the next step decodes its second token.
    (stepped,) = decode.step()
    assert stepped.request_id == "again" and stepped.token_ids == oracle_llama.generate(prompt, 2)
    assert decode.abort_request("again") is not None
    assert prefill.leases.release(held.request_id)


def test_a_remote_request_with_blocks_to_fill_does_not_land_without_its_kv(llama_checkpoint: Path) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    held = prefill_and_hold(prefill, PROMPT, GREEDY)
    assert held.kv_handoff is not None
    decode.kv_connector.add_remote_request("r", PROMPT, GREEDY, held.kv_handoff)
    (slot,) = decode.kv_connector.drain_kv_slots()
    assert slot == KVSlot("r", 0)
    assert decode.kv_connector.join_if_present(slot) is None
    assert list(decode.scheduler.receiving) == ["r"] and decode.step() == []
    decode.abort_request("r")
    assert decode.kv_connector.join_if_present(slot) is None  # no longer waiting: nothing to land
    assert decode.block_manager.num_used_blocks == 0


@pytest.mark.asyncio
async def test_async_import_of_kv_that_is_all_here_asks_for_none(llama_checkpoint: Path, oracle_llama: Oracle) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    prompt = random_prompts([32], seed=63)[0]
    async_engine = AsyncEngine(decode)
    async_engine.start()
    try:
        asked: list[tuple[str, int]] = []
        for request_id in ("first", "second"):
            held = prefill_and_hold(prefill, prompt, GREEDY)
            assert held.kv_handoff is not None

            async def receive_kv(first_block: int, held=held, request_id=request_id) -> torch.Tensor:
                asked.append((request_id, first_block))
                return prefill.leases.export(held.request_id, first_block)

            stream = async_engine.import_request(request_id, prompt, GREEDY, held.kv_handoff, receive_kv)
            assert await _collect(stream) == oracle_llama.generate(prompt, MAX_TOKENS)
            prefill.leases.release(held.request_id)
        # The second found both blocks in the prefix cache: it ran without asking for any KV.
        assert asked == [("first", 0)]
        assert await async_engine.call(lambda e: e.block_manager.num_used_blocks) == 0
    finally:
        await async_engine.stop()
