"""An idle engine that gets prompts gathers the requests arriving right behind them before its first step.

``AsyncEngine(batch_window=BatchWindow(...))`` (``pdserve.engine.batch_window``): the first step of a burst takes the whole
burst (up to the step's budget), as ``LLM.generate``'s first step takes every
prompt it was given, instead of the first request alone. These tests widen the
arrival gap (3 ms in service) so that the sleeps between their requests are far
inside it, or far outside the window.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.batch_window import BatchWindow
from tests.conftest import random_prompts
from tests.support.step_log import StepLog

PROMPTS = random_prompts([12, 9, 15], seed=97)
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


async def _collect(async_engine: AsyncEngine, prompt: list[int], request_id: str, delay_s: float) -> list[int]:
    await asyncio.sleep(delay_s)
    outputs = [output async for output in async_engine.generate(prompt, PARAMS, request_id)]
    return outputs[-1].token_ids


async def _first_step(llm: LLM, delays_s: list[float], **window: float) -> tuple[int, list[str]]:
    """Send ``PROMPTS`` at ``delays_s`` to an idle engine; how many requests it had at its first step and which
    ones that step gave a token. Checks every request's tokens."""
    expected = [output.token_ids for output in llm.generate(PROMPTS, PARAMS)]
    log = StepLog(llm.engine)
    async_engine = AsyncEngine(llm.engine, batch_window=BatchWindow(**window))
    async_engine.start()
    try:
        tokens = await asyncio.wait_for(asyncio.gather(*(
            _collect(async_engine, prompt, f"r{i}", delay) for i, (prompt, delay) in enumerate(zip(PROMPTS, delays_s))
        )), timeout=60)
    finally:
        await async_engine.stop()
    assert tokens == expected
    return log.steps[0]


@pytest.mark.asyncio
async def test_requests_arriving_within_the_gap_of_each_other_share_the_first_step(llama_checkpoint: Path) -> None:
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64)
    first = await _first_step(llm, [0.0, 0.1, 0.2], window_s=30.0, arrival_gap_s=2.0)
    assert first == (3, ["r0", "r1", "r2"])


@pytest.mark.asyncio
async def test_without_a_window_the_first_request_steps_alone(llama_checkpoint: Path) -> None:
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64)
    assert await _first_step(llm, [0.0, 0.5, 0.5]) == (1, ["r0"])


@pytest.mark.asyncio
async def test_the_window_closes_when_no_request_comes_within_the_gap(llama_checkpoint: Path) -> None:
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64)
    assert await _first_step(llm, [0.0, 1.5, 1.5], window_s=30.0, arrival_gap_s=0.2) == (1, ["r0"])


@pytest.mark.asyncio
async def test_the_window_closes_at_its_end_though_requests_keep_coming(llama_checkpoint: Path) -> None:
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64)
    # r1 comes within the gap and the window; r2 within the gap of r1 but past the window's end.
    first = await _first_step(llm, [0.0, 0.3, 2.0], window_s=1.0, arrival_gap_s=2.0)
    assert first == (2, ["r0", "r1"])


@pytest.mark.asyncio
async def test_a_full_first_step_does_not_wait(llama_checkpoint: Path) -> None:
    # The first prompt takes the step's whole token budget: waiting could add nothing to that step, which
    # starts before the others arrive.
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=len(PROMPTS[0]))
    assert await _first_step(llm, [0.0, 0.5, 0.5], window_s=30.0, arrival_gap_s=2.0) == (1, ["r0"])
