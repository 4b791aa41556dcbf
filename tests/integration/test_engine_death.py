"""When the engine thread dies or stops, everyone waiting on it hears so at once: nothing hangs.

A command queued behind the step that fails never runs; its caller must get
``EngineDeadError``, not wait forever (a worker whose engine died would
otherwise hold its in-flight RPCs open through the whole drain).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.types.errors import EngineDeadError
from tests.conftest import random_prompts
from tests.support.held_step import HeldStep

PROMPT = random_prompts([20], seed=71)[0]
PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


async def _read_to_the_end(stream) -> None:  # noqa: ANN001
    async for output in stream:
        assert not output.finished


@pytest.mark.asyncio
async def test_calls_queued_when_the_engine_dies_fail_and_later_ones_are_refused(llama_checkpoint: Path) -> None:
    engine = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=32).engine
    failing = HeldStep(engine, failure=RuntimeError("injected step failure"))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        stream = async_engine.generate(PROMPT, PARAMS, "victim")
        first = await anext(stream)
        assert first.finished is False
        failing.armed.set()
        assert await asyncio.to_thread(failing.entered.wait, 30)
        # Queued while the failing step runs: the thread never gets back to its commands.
        queued = asyncio.ensure_future(async_engine.call(lambda e: e.block_manager.num_used_blocks))
        await asyncio.sleep(0.05)
        assert not queued.done()
        failing.release.set()
        with pytest.raises(EngineDeadError, match="injected step failure"):
            await asyncio.wait_for(queued, timeout=10)
        with pytest.raises(EngineDeadError, match="injected step failure"):
            # Outputs of the steps before the failure may come first; the request never finishes.
            await asyncio.wait_for(_read_to_the_end(stream), timeout=10)
        assert async_engine.is_alive is False
        with pytest.raises(EngineDeadError, match="injected step failure"):
            await asyncio.wait_for(async_engine.call(lambda e: 0), timeout=10)
        fresh = async_engine.generate(PROMPT, PARAMS, "after")
        with pytest.raises(EngineDeadError, match="injected step failure"):
            await asyncio.wait_for(anext(fresh), timeout=10)
    finally:
        failing.release.set()
        await async_engine.stop()


@pytest.mark.asyncio
async def test_calls_queued_when_the_engine_stops_fail_with_shutting_down(llama_checkpoint: Path) -> None:
    engine = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=32).engine
    async_engine = AsyncEngine(engine)
    async_engine.start()
    blocked, release = threading.Event(), threading.Event()

    def hold(_: LLMEngine) -> None:
        blocked.set()
        release.wait(timeout=30)

    try:
        holding = asyncio.ensure_future(async_engine.call(hold))
        assert await asyncio.to_thread(blocked.wait, 30)
        # Queued while ``hold`` runs, so after the thread took its round of commands from the queue.
        queued = asyncio.ensure_future(async_engine.call(lambda e: 1))
        await asyncio.sleep(0.05)
        async_engine._stopping.set()  # what stop() sets first: the thread leaves after this round
        release.set()
        await asyncio.wait_for(holding, timeout=10)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await asyncio.wait_for(queued, timeout=10)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await asyncio.wait_for(async_engine.call(lambda e: 2), timeout=10)
    finally:
        release.set()
        await async_engine.stop()
