"""The scheduler's decisions on tiny pools, driven without a model (a fake step appends tokens)."""

from __future__ import annotations

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.types.config import SchedulerConfig
from pdserve.engine.types.sampling_params import SamplingParams
from tests.support.scheduling import fake_step, plan

BS = 4


def _seq(request_id: str, num_tokens: int, first_token: int = 0) -> Sequence:
    tokens = list(range(first_token, first_token + num_tokens))
    return Sequence(request_id, tokens, SamplingParams(max_tokens=100), BS, "tiny")


def _scheduler(num_blocks: int, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), BlockManager(num_blocks, BS))


def test_decodes_and_a_chunked_prefill_share_the_token_budget() -> None:
    scheduler = _scheduler(num_blocks=32, budget=10)
    a, b = _seq("a", 6), _seq("b", 30, first_token=100)
    scheduler.add(a)
    scheduler.add(b)
    assert plan(fake_step(scheduler)) == [("a", 0, 6), ("b", 0, 4)]
    # a decodes one token; b's prefill continues in chunks with the rest of the budget.
    assert plan(fake_step(scheduler)) == [("a", 6, 1), ("b", 4, 9)]
    assert plan(fake_step(scheduler)) == [("a", 7, 1), ("b", 13, 9)]
    assert plan(fake_step(scheduler)) == [("a", 8, 1), ("b", 22, 8)]
    out = fake_step(scheduler)
    assert plan(out) == [("a", 9, 1), ("b", 30, 1)]
    assert all(item.samples for item in out.scheduled)


def test_max_num_seqs_caps_the_running_batch() -> None:
    scheduler = _scheduler(num_blocks=32, max_num_seqs=2)
    for name in "abc":
        scheduler.add(_seq(name, 3))
    out = fake_step(scheduler)
    assert [item.seq.request_id for item in out.scheduled] == ["a", "b"]
    assert scheduler.num_waiting == 1
    scheduler.finish(scheduler.running[0], "stop")
    assert plan(fake_step(scheduler)) == [("b", 3, 1), ("c", 0, 3)]


def test_out_of_blocks_preempts_the_newest_running_sequence_for_recompute() -> None:
    scheduler = _scheduler(num_blocks=4)
    a, b = _seq("a", 4), _seq("b", 4, first_token=50)
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler)  # both prefilled: 1 block each, each sampled a 5th token
    out = fake_step(scheduler)  # each needs a second block: 4 blocks, fits
    assert plan(out) == [("a", 4, 1), ("b", 4, 1)]
    for _ in range(3):
        fake_step(scheduler)
    # a and b now hold 9 tokens each and need a third block: only one exists.
    out = fake_step(scheduler)
    assert out.preempted == ("b",)
    assert plan(out) == [("a", 8, 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b
    assert scheduler.num_preemptions == 1
    # b keeps its generated tokens and recomputes once a finishes. Its head block
    # is still cached; its tail block was the one a took, so 5 tokens run again.
    scheduler.finish(a, "stop")
    assert plan(fake_step(scheduler)) == [("b", 4, 5)]


def test_a_waiting_request_that_does_not_fit_blocks_those_behind_it() -> None:
    scheduler = _scheduler(num_blocks=4)
    scheduler.add(_seq("big", 14))
    scheduler.add(_seq("huge", 20, first_token=100))
    scheduler.add(_seq("small", 2, first_token=200))
    out = fake_step(scheduler)
    # huge needs 5 blocks and only 0 remain: small waits behind it, first come first served.
    assert [item.seq.request_id for item in out.scheduled] == ["big"]


def test_finished_waiting_requests_are_skipped_and_free_nothing_twice() -> None:
    scheduler = _scheduler(num_blocks=8)
    a, b = _seq("a", 3), _seq("b", 3, first_token=10)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.finish(a, "abort")
    assert a.finish_reason == "abort"
    assert [item.seq.request_id for item in fake_step(scheduler).scheduled] == ["b"]
    scheduler.finish(a, "abort")
    assert scheduler.block_manager.num_used_blocks == 1
