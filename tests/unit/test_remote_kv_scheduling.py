"""Requests prefilled elsewhere (WAITING_FOR_REMOTE_KVS) on tiny pools, driven without a model."""

from __future__ import annotations

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.types.config import SchedulerConfig
from pdserve.engine.types.handoff import KVReservation, KVSlot
from pdserve.engine.types.hashing import hash_prompt_blocks
from pdserve.engine.types.sampling_params import SamplingParams
from tests.support.scheduling import fake_step, plan

BS = 4
MODEL = "tiny"


def _scheduler(num_blocks: int, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), BlockManager(num_blocks, BS))


def _local(request_id: str, num_tokens: int, first_token: int = 0) -> Sequence:
    return Sequence(request_id, list(range(first_token, first_token + num_tokens)), SamplingParams(max_tokens=100), BS, MODEL)


def _remote(request_id: str, num_prompt_tokens: int, first_token: int = 0) -> Sequence:
    """What ``LLMEngine.add_remote_request`` builds: the handoff's hashes seeded, the first token appended."""
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    seq = Sequence(
        request_id, prompt, SamplingParams(max_tokens=100), BS, MODEL,
        block_hashes=tuple(hash_prompt_blocks(prompt, BS, MODEL)),
    )
    seq.append_token(999)
    seq.num_computed_tokens = num_prompt_tokens
    return seq


def test_remote_request_gets_blocks_at_once_and_is_not_scheduled_before_its_kv_lands() -> None:
    scheduler = _scheduler(num_blocks=8)
    r = _remote("r", 10)  # 2 full blocks and a partial one
    scheduler.add_remote(r)
    assert scheduler.drain_kv_slots() == [KVSlot("r", 0)]
    assert scheduler.drain_kv_slots() == []
    assert r.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert r.block_table == [0, 1, 2] and scheduler.block_manager.num_free_blocks == 5
    assert scheduler.receiving == {"r": r} and not scheduler.has_work()
    assert plan(fake_step(scheduler)) == []
    scheduler.kv_received(r)
    assert r.status is SequenceStatus.RUNNING and scheduler.receiving == {}
    # Only the first token is left to compute: one decode at position 10.
    assert plan(fake_step(scheduler)) == [("r", 10, 1)]


def test_abort_while_waiting_for_kv_frees_its_blocks() -> None:
    scheduler = _scheduler(num_blocks=8)
    r = _remote("r", 10)
    scheduler.add_remote(r)
    assert scheduler.block_manager.num_free_blocks == 5
    scheduler.finish(r, "abort")
    assert r.status is SequenceStatus.FINISHED and r.finish_reason == "abort"
    assert scheduler.block_manager.num_free_blocks == 8 and r.block_table == []
    assert scheduler.receiving == {} and not scheduler.has_work()
    assert plan(fake_step(scheduler)) == []


def test_remote_requests_queue_for_blocks_first_come_first_served() -> None:
    scheduler = _scheduler(num_blocks=5)
    a = _local("a", 11)  # 3 blocks
    scheduler.add(a)
    assert plan(fake_step(scheduler)) == [("a", 0, 11)]
    r = _remote("r", 10, first_token=100)  # needs 3 blocks, 2 are free
    scheduler.add_remote(r)
    c = _local("c", 3, first_token=200)  # would fit, but comes after r
    scheduler.add(c)
    assert scheduler.drain_kv_slots() == [] and r.block_table == []
    assert r.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert plan(fake_step(scheduler)) == [("a", 11, 1)]
    assert scheduler.drain_kv_slots() == []
    scheduler.finish(a, "stop")
    # a's blocks are back: r gets its three first, then c is admitted with the last two.
    assert plan(fake_step(scheduler)) == [("c", 0, 3)]
    assert scheduler.drain_kv_slots() == [KVSlot("r", 0)]
    assert len(r.block_table) == 3 and scheduler.block_manager.num_free_blocks == 1


def test_abort_while_queued_for_blocks_never_allocates() -> None:
    scheduler = _scheduler(num_blocks=4)
    a = _local("a", 11)
    scheduler.add(a)
    fake_step(scheduler)
    r = _remote("r", 10, first_token=100)
    scheduler.add_remote(r)
    scheduler.finish(r, "abort")
    scheduler.finish(a, "stop")
    assert plan(fake_step(scheduler)) == []
    assert scheduler.drain_kv_slots() == [] and r.block_table == []
    assert scheduler.block_manager.num_free_blocks == 4 and scheduler.num_waiting == 0


def test_cached_prefix_blocks_are_shared_and_only_the_rest_is_filled() -> None:
    scheduler = _scheduler(num_blocks=8)
    a = _local("a", 9)  # computes and caches blocks of tokens 0-3 and 4-7
    scheduler.add(a)
    fake_step(scheduler)
    cached = a.block_table[:2]
    scheduler.finish(a, "stop")
    r = _remote("r", 10)  # the same first 8 tokens
    scheduler.add_remote(r)
    assert scheduler.drain_kv_slots() == [KVSlot("r", 2)]
    assert r.block_table[:2] == cached and len(r.block_table) == 3


def test_kv_that_never_lands_is_recomputed_first_in_line() -> None:
    scheduler = _scheduler(num_blocks=8)
    b = _local("b", 3, first_token=50)
    r = _remote("r", 10)
    scheduler.add_remote(r)
    scheduler.add(b)
    scheduler.kv_lost(r)
    assert r.status is SequenceStatus.WAITING and r.block_table == [] and r.num_computed_tokens == 0
    assert scheduler.block_manager.num_free_blocks == 8
    # Prompt and first token are computed here, ahead of b (the path of a preempted sequence).
    assert plan(fake_step(scheduler)) == [("r", 0, 11), ("b", 0, 3)]


def test_requests_waiting_for_kv_count_against_max_num_seqs() -> None:
    scheduler = _scheduler(num_blocks=16, max_num_seqs=2)
    r, s, t = _remote("r", 5), _remote("s", 5, first_token=100), _remote("t", 5, first_token=200)
    for seq in (r, s, t):
        scheduler.add_remote(seq)
    assert scheduler.drain_kv_slots() == [KVSlot("r", 0), KVSlot("s", 0)]
    assert t.block_table == []
    scheduler.finish(r, "abort")
    fake_step(scheduler)
    assert scheduler.drain_kv_slots() == [KVSlot("t", 0)]


def test_pushed_kv_in_reserved_blocks_is_adopted_and_nothing_is_left_to_fill() -> None:
    scheduler = _scheduler(num_blocks=8)
    manager = scheduler.block_manager
    reservation = KVReservation(0, tuple(manager.reserve(3)))
    assert reservation.block_ids == (0, 1, 2) and manager.num_free_blocks == 5
    r = _remote("r", 10)
    r.kv_reservation = reservation
    scheduler.add_remote(r)
    # The slot starts past the last block: the KV is in place, nothing is fetched or copied.
    assert scheduler.drain_kv_slots() == [KVSlot("r", 3)]
    assert r.block_table == [0, 1, 2] and r.kv_reservation is None
    assert [manager.ref_count(b) for b in range(3)] == [1, 1, 1] and manager.num_free_blocks == 5
    scheduler.finish(r, "stop")
    assert manager.num_free_blocks == 8


def test_reserved_blocks_the_prefix_cache_makes_redundant_go_back_to_the_front_of_the_free_queue() -> None:
    scheduler = _scheduler(num_blocks=8)
    manager = scheduler.block_manager
    a = _local("a", 9)  # caches blocks 0 and 1 (tokens 0-7); block 2 holds the partial rest
    scheduler.add(a)
    fake_step(scheduler)
    scheduler.finish(a, "stop")
    assert manager.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    reservation = KVReservation(0, tuple(manager.reserve(3)))
    assert reservation.block_ids == (2, 3, 4)
    r = _remote("r", 10)  # the same first 8 tokens
    r.kv_reservation = reservation
    scheduler.add_remote(r)
    assert scheduler.drain_kv_slots() == [KVSlot("r", 3)]
    # Cached blocks for positions 0-1, the pushed copy of position 2; the pushed 0-1 are freed.
    assert r.block_table == [0, 1, 4]
    assert manager.free_block_ids() == [3, 2, 5, 6, 7]


def test_pushed_blocks_after_an_uncached_gap_are_fetched_again_from_the_gap() -> None:
    scheduler = _scheduler(num_blocks=8)
    manager = scheduler.block_manager
    # The push started at block 2 (the sender expected blocks 0-1 cached here), but they are not.
    reservation = KVReservation(2, tuple(manager.reserve(1)))
    r = _remote("r", 10)
    r.kv_reservation = reservation
    scheduler.add_remote(r)
    assert scheduler.drain_kv_slots() == [KVSlot("r", 0)]
    assert r.block_table == [1, 2, 0] and manager.num_free_blocks == 5


def test_abort_before_allocation_frees_the_reserved_blocks() -> None:
    scheduler = _scheduler(num_blocks=4)
    manager = scheduler.block_manager
    a = _local("a", 11)
    scheduler.add(a)
    fake_step(scheduler)  # a holds 3 blocks
    reservation = KVReservation(2, tuple(manager.reserve(1)))  # the last of r's 3 blocks
    r = _remote("r", 10, first_token=100)
    r.kv_reservation = reservation
    scheduler.add_remote(r)  # queued: a is ahead in line for blocks
    assert scheduler.drain_kv_slots() == [] and manager.num_free_blocks == 0
    scheduler.finish(r, "abort")
    assert r.kv_reservation is None and manager.num_free_blocks == 1
    scheduler.finish(a, "stop")
    assert manager.num_free_blocks == 4


def test_only_prompts_to_compute_here_leave_room_for_arrivals_in_the_next_step() -> None:
    # What an idle engine's batch window waits for (AsyncEngine._gather_arrivals): prompts, not remote KV.
    scheduler = _scheduler(num_blocks=16, max_num_seqs=3, budget=12)
    scheduler.add_remote(_remote("r", 10))
    assert scheduler.next_step_has_room_for_prompts() is False
    scheduler.add(_local("a", 5))
    assert scheduler.next_step_has_room_for_prompts() is True
    scheduler.add(_local("b", 7, first_token=50))  # 5 + 7 + r's 1 token left: past the 12-token budget
    assert scheduler.next_step_has_room_for_prompts() is False


def test_the_sequence_limit_also_fills_the_next_step() -> None:
    scheduler = _scheduler(num_blocks=16, max_num_seqs=2, budget=64)
    scheduler.add(_local("a", 3))
    assert scheduler.next_step_has_room_for_prompts() is True
    scheduler.add(_local("b", 3, first_token=50))
    assert scheduler.next_step_has_room_for_prompts() is False
