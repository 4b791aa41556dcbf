"""Where a worker's OpenMP spin governor gets to look at the machine: between the layers of every step, and before
engine commands when no step runs (a decode worker writing pushed KV in while it has nothing to decode)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from tests.conftest import random_prompts


def test_between_layers_runs_between_every_two_layers_of_each_step(llama_checkpoint: Path) -> None:
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=32)
    engine = llm.engine
    num_layers = engine.kv_layout.num_layers
    calls: list[int] = []
    engine.between_layers = lambda: calls.append(len(calls))
    prompt = random_prompts([20], seed=171)[0]
    without = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=32).generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outputs = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # Three steps (the prompt's, then two decode steps), nothing computed differently.
    assert len(calls) == 3 * (num_layers - 1)
    assert outputs[0].token_ids == without[0].token_ids
    engine.between_layers = None
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(calls) == 3 * (num_layers - 1)


@pytest.mark.asyncio
async def test_before_work_runs_before_commands_on_an_engine_with_nothing_to_step(llama_checkpoint: Path) -> None:
    engine = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=32).engine
    ran: list[str] = []  # both run on the engine thread
    async_engine = AsyncEngine(engine, before_work=lambda: ran.append("before_work"))
    async_engine.start()
    try:
        for _ in range(3):
            await async_engine.call(lambda e: ran.append("command"))
            await asyncio.sleep(0.1)  # the engine thread goes back to waiting for commands
        assert ran == ["before_work", "command"] * 3
    finally:
        await async_engine.stop()
