"""A decode engine holds a step briefly for requests whose pushed KV has fully landed, so that they join it.

A prefill step's requests finish together; their pushes complete together and
their starts reach the decode worker a few milliseconds apart. Without the hold
the first start's step runs without the rest, and they wait a whole step more
for their second tokens (``pdserve.engine.batch_window``). Real engines
here: a prefill engine holds each prompt's KV, and the test lands it in the
decode engine's reserved blocks layer by layer, as a decode worker's push inbox
does (through the engine's KV connector).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.batch_window import BatchWindow
from pdserve.engine.kv.connector import PushedKV
from pdserve.engine.kv.handoff import KVFetch
from pdserve.engine.types.handoff import KVHandoff
from tests.conftest import Oracle, random_prompts
from tests.support.handoff import prefill_and_hold
from tests.support.step_log import StepLog

MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([37, 21, 30], seed=151)  # 3, 2 and 2 blocks of 16


@pytest.fixture(scope="module")
def oracle(llama_checkpoint: Path) -> Oracle:
    return Oracle(llama_checkpoint)


def _engine(path: Path) -> LLMEngine:
    return LLM(model=str(path), dtype="float32", num_kv_blocks=64).engine


def _held(prefill: LLMEngine, prompt: list[int]) -> tuple[KVHandoff, torch.Tensor]:
    """The prompt's handoff and its whole KV, as the prefill worker would push it."""
    held = prefill_and_hold(prefill, prompt, GREEDY)
    assert held.kv_handoff is not None
    blocks = prefill.leases.export(held.request_id, 0)
    prefill.leases.release(held.request_id)
    return held.kv_handoff, blocks


async def _land(async_engine: AsyncEngine, handoff: KVHandoff, blocks: torch.Tensor,
                log: StepLog | None = None) -> tuple[PushedKV, int]:
    """Reserve and write the whole push layer by layer, the last layer by a command of its own after the others;
    the push, and how many steps ``log`` had seen when that last layer was written."""
    push = await async_engine.call(
        lambda e: e.kv_connector.open_push(handoff.request_id, handoff.layout, 0, blocks.shape[2]))
    last = blocks.shape[0] - 1
    for layer in range(last):
        async_engine.submit(lambda e, layer=layer: e.kv_connector.write_push(push, layer, 0, blocks[layer : layer + 1]))

    def write_last(engine: LLMEngine) -> int:
        engine.kv_connector.write_push(push, last, 0, blocks[last:])
        return len(log.steps) if log is not None else 0

    return push, await async_engine.call(write_last)


async def _never(first_block: int) -> torch.Tensor | KVFetch | None:
    raise AssertionError(f"a fully pushed request fetched its KV from block {first_block}")


async def _tokens(stream) -> list[int]:  # noqa: ANN001
    tokens: list[int] = []
    async for output in stream:
        tokens = output.token_ids
    return tokens


def _import(async_engine: AsyncEngine, request_id: str, prompt: list[int], handoff: KVHandoff) -> asyncio.Task[list[int]]:
    """The request whose KV was pushed, adopting the push."""
    stream = async_engine.import_request(request_id, prompt, GREEDY, handoff, _never, pushed=True)
    return asyncio.ensure_future(_tokens(stream))


async def _idle_engine_first_step(llama_checkpoint: Path, oracle: Oracle, **window: float) -> list[str]:
    """Two pushes land on an idle decode engine; a's request starts, b's 0.3 s later. The first step's requests."""
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    (handoff_a, blocks_a), (handoff_b, blocks_b) = _held(prefill, PROMPTS[0]), _held(prefill, PROMPTS[1])
    log = StepLog(decode)
    async_engine = AsyncEngine(decode, batch_window=BatchWindow(**window))
    async_engine.start()
    try:
        await _land(async_engine, handoff_a, blocks_a)
        await _land(async_engine, handoff_b, blocks_b)
        a = _import(async_engine, "a", PROMPTS[0], handoff_a)
        await asyncio.sleep(0.3)
        b = _import(async_engine, "b", PROMPTS[1], handoff_b)
        tokens = await asyncio.wait_for(asyncio.gather(a, b), timeout=60)
        assert await async_engine.call(lambda e: e.block_manager.num_used_blocks) == 0
    finally:
        await async_engine.stop()
    assert tokens == [oracle.generate(PROMPTS[0], MAX_TOKENS), oracle.generate(PROMPTS[1], MAX_TOKENS)]
    return log.steps[0][1]


@pytest.mark.asyncio
async def test_an_idle_engine_holds_its_first_step_for_a_landed_push_whose_request_comes_later(
    llama_checkpoint: Path, oracle: Oracle
) -> None:
    assert await _idle_engine_first_step(llama_checkpoint, oracle, window_s=30.0) == ["a", "b"]


@pytest.mark.asyncio
async def test_without_a_window_the_first_started_request_steps_alone(llama_checkpoint: Path, oracle: Oracle) -> None:
    assert await _idle_engine_first_step(llama_checkpoint, oracle) == ["a"]


RUNNING = random_prompts([20, 25, 18], seed=152)
STEP_S = 0.6  # a busy engine's steps here: the hold's bound is a share of the last one


async def _busy_engine_steps(llama_checkpoint: Path, oracle: Oracle, streams: int = 1, start_delay_s: float = 0.0,
                             **window: float) -> tuple[int, int]:
    """``streams`` requests decode in 0.6 s steps; a push lands between two steps and its request starts
    ``start_delay_s`` later. How many steps had run when it landed, and the first step that gave it a token."""
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    handoff, blocks = _held(prefill, PROMPTS[1])
    log = StepLog(decode, sleep_s=STEP_S)
    async_engine = AsyncEngine(decode, batch_window=BatchWindow(**window))
    async_engine.start()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        running_streams = [async_engine.generate(prompt, params, f"running-{i}")
                           for i, prompt in enumerate(RUNNING[:streams])]
        # Their prompts' step has run: they decode from now on.
        firsts = [await anext(stream) for stream in running_streams]
        running = asyncio.gather(*(_tokens(stream) for stream in running_streams))
        _, steps_at_landing = await _land(async_engine, handoff, blocks, log)
        await asyncio.sleep(start_delay_s)
        pushed = await asyncio.wait_for(_import(async_engine, "pushed", PROMPTS[1], handoff), timeout=60)
        running_tokens = await asyncio.wait_for(running, timeout=60)
        assert await async_engine.call(lambda e: e.block_manager.num_used_blocks) == 0
    finally:
        await async_engine.stop()
    assert [len(first.token_ids) for first in firsts] == [1] * streams
    assert running_tokens == [oracle.generate(prompt, 8) for prompt in RUNNING[:streams]]
    assert pushed == oracle.generate(PROMPTS[1], MAX_TOKENS)
    return steps_at_landing, log.first_step_of("pushed")


@pytest.mark.asyncio
async def test_a_busy_engine_holds_the_next_step_for_a_landed_push_whose_request_is_on_its_way(
    llama_checkpoint: Path, oracle: Oracle
) -> None:
    # One stream running, one request on its way: the hold may last a step (0.6 s). The start comes 0.3 s
    # after the landing, within it, and the very next step gives the pushed request its second token.
    steps_at_landing, first = await _busy_engine_steps(llama_checkpoint, oracle, 1, 0.3, window_s=30.0)
    assert first == steps_at_landing


@pytest.mark.asyncio
async def test_without_a_window_a_busy_engine_steps_on_and_the_pushed_request_waits_a_step(
    llama_checkpoint: Path, oracle: Oracle
) -> None:
    steps_at_landing, first = await _busy_engine_steps(llama_checkpoint, oracle)
    assert first == steps_at_landing + 1


@pytest.mark.asyncio
async def test_the_hold_shrinks_with_the_streams_it_holds_up(llama_checkpoint: Path, oracle: Oracle) -> None:
    # Three streams for one request on its way: a third of a step (0.2 s). The start comes 0.3 s after the
    # landing, past it: the engine stepped on, and the pushed request joins the step after.
    steps_at_landing, first = await _busy_engine_steps(llama_checkpoint, oracle, 3, 0.3, window_s=30.0)
    assert first == steps_at_landing + 1


@pytest.mark.asyncio
async def test_the_hold_never_outlasts_the_window(llama_checkpoint: Path, oracle: Oracle) -> None:
    # A step's worth would be 0.6 s; the window is 0.1 s.
    steps_at_landing, first = await _busy_engine_steps(llama_checkpoint, oracle, 1, 0.3, window_s=0.1)
    assert first == steps_at_landing + 1


@pytest.mark.asyncio
async def test_a_landed_push_whose_request_never_comes_holds_nothing_for_good(
    llama_checkpoint: Path, oracle: Oracle
) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    (handoff, blocks), (orphan_handoff, orphan_blocks) = _held(prefill, PROMPTS[0]), _held(prefill, PROMPTS[2])
    async_engine = AsyncEngine(decode, batch_window=BatchWindow(0.5))
    async_engine.start()
    try:
        orphan, _ = await _land(async_engine, orphan_handoff, orphan_blocks)
        await _land(async_engine, handoff, blocks)
        # The request steps once the orphan's hold is over (it landed over half a second ago by then).
        tokens = await asyncio.wait_for(_import(async_engine, "a", PROMPTS[0], handoff), timeout=30)
        assert tokens == oracle.generate(PROMPTS[0], MAX_TOKENS)
        # Still reserved until the handoff deadline drops it (or its request's worker drops it).
        assert await async_engine.call(lambda e: e.kv_connector.pushes_landed_since(0.0)) == 1
        await async_engine.call(lambda e: e.kv_connector.drop_push(orphan.request_id))
        assert await async_engine.call(
            lambda e: (e.kv_connector.pushes_landed_since(0.0), e.block_manager.num_used_blocks)) == (0, 0)
    finally:
        await async_engine.stop()


def test_a_push_counts_as_landed_from_its_last_pieces_last_layer_until_a_request_adopts_it(
    llama_checkpoint: Path,
) -> None:
    prefill, decode = _engine(llama_checkpoint), _engine(llama_checkpoint)
    handoff, blocks = _held(prefill, PROMPTS[0])  # 3 blocks
    last = blocks.shape[0] - 1
    connector = decode.kv_connector
    push = connector.open_push(handoff.request_id, handoff.layout, 0, 3)
    # An earlier chunk's piece (blocks 0-1), every layer of it: the prompt goes on, nothing has landed.
    for layer in range(last + 1):
        connector.write_push(push, layer, 0, blocks[layer : layer + 1, :, :2])
    # The piece that ends the prompt, all but its last layer.
    for layer in range(last):
        connector.write_push(push, layer, 0, blocks[layer : layer + 1])
    assert connector.pushes_landed_since(0.0) == 0
    before = time.monotonic()
    connector.write_push(push, last, 0, blocks[last:])
    assert connector.pushes_landed_since(before) == 1
    assert connector.pushes_landed_since(time.monotonic() + 1.0) == 0  # landed before that: no longer counted
    connector.add_remote_request("a", PROMPTS[0], GREEDY, handoff, pushed=True)
    assert connector.pushes_landed_since(0.0) == 0
    decode.abort_request("a")
    assert decode.block_manager.num_used_blocks == 0
