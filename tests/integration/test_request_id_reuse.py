"""A request id used again at once gets only its own request's outputs.

A stream that closes before its request finished queues the request's abort
behind whatever the engine thread is doing. If the same id is used again
meanwhile (a decode worker ending the request its push started and serving the
Decode that differs from it, under the same id), the step running when the old
stream closed still produces an output of the old request. That output must not
reach the new stream: the new request's first output would be the old one's
tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.types.outputs import RequestOutput
from tests.conftest import random_prompts
from tests.support.held_step import HeldStep

OLD_PROMPT, NEW_PROMPT = random_prompts([20, 13], seed=83)
OLD_PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
NEW_PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
NEW_LENGTHS = [1, 2, 3, 4, 5, 6]  # one output per step, each one token longer than the last


@contextlib.asynccontextmanager
async def _held_engine(checkpoint: Path) -> AsyncIterator[tuple[AsyncEngine, HeldStep, list[int]]]:
    """A started engine whose steps the test can hold, and the tokens ``NEW_PROMPT`` must get. Checks at the end
    that nothing is left running or holding blocks."""
    llm = LLM(model=str(checkpoint), dtype="float32", num_kv_blocks=32)
    expected = llm.generate([NEW_PROMPT], NEW_PARAMS)[0].token_ids
    held = HeldStep(llm.engine)
    async_engine = AsyncEngine(llm.engine)
    async_engine.start()
    try:
        yield async_engine, held, expected
        stats = await async_engine.call(lambda engine: (engine.has_work(), engine.block_manager.num_used_blocks))
        assert stats == (False, 0)
    finally:
        held.release.set()
        await async_engine.stop()


async def _hold_a_step_of(async_engine: AsyncEngine, held: HeldStep, request_id: str) -> AsyncIterator[RequestOutput]:
    """Start ``OLD_PROMPT`` as ``request_id`` and hold the engine thread inside a step that computes it; its stream."""
    stream = async_engine.generate(OLD_PROMPT, OLD_PARAMS, request_id)
    assert (await anext(stream)).prompt_token_ids == OLD_PROMPT
    held.armed.set()
    assert await asyncio.to_thread(held.entered.wait, 30)
    return stream


async def _queued_commands(async_engine: AsyncEngine, count: int) -> None:
    """Wait until ``count`` commands wait for the engine thread (it is held in a step)."""
    for _ in range(1000):
        if async_engine._commands.qsize() >= count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{count} commands were never queued")


@pytest.mark.asyncio
async def test_an_id_used_again_while_its_old_request_steps_gets_only_the_new_requests_outputs(
    llama_checkpoint: Path,
) -> None:
    async with _held_engine(llama_checkpoint) as (async_engine, held, expected):
        old = await _hold_a_step_of(async_engine, held, "same")
        # The old request is in a step: closing its stream queues its abort behind that step.
        await old.aclose()
        await _queued_commands(async_engine, 1)
        new = async_engine.generate(NEW_PROMPT, NEW_PARAMS, "same")
        first = asyncio.ensure_future(anext(new))
        await _queued_commands(async_engine, 2)  # the old request's abort, then the new one's add
        held.release.set()  # the held step ends with an output of the old request
        outputs = [await asyncio.wait_for(first, timeout=30)]
        async for output in new:
            outputs.append(output)
        assert [output.prompt_token_ids for output in outputs] == [NEW_PROMPT] * len(NEW_LENGTHS)
        assert [len(output.token_ids) for output in outputs] == NEW_LENGTHS
        assert outputs[-1].token_ids == expected
        assert outputs[-1].finished is True


@pytest.mark.asyncio
async def test_a_caller_gone_before_its_request_was_added_leaves_the_id_free_and_no_blocks_held(
    llama_checkpoint: Path,
) -> None:
    async with _held_engine(llama_checkpoint) as (async_engine, held, expected):
        running = await _hold_a_step_of(async_engine, held, "running")
        gone = asyncio.ensure_future(anext(async_engine.generate(NEW_PROMPT, NEW_PARAMS, "reused")))
        await _queued_commands(async_engine, 1)  # its add waits behind the held step
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        await running.aclose()
        held.release.set()
        # The add ran after its caller left: the request was aborted, and nothing reads or holds the id.
        outputs = [output async for output in async_engine.generate(NEW_PROMPT, NEW_PARAMS, "reused")]
        assert [len(output.token_ids) for output in outputs] == NEW_LENGTHS
        assert outputs[-1].token_ids == expected
        assert async_engine._streams == {}
