"""``PushTable``: the decode connector's record of pushed KV, on a tiny pool with exact block ids."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.connector import PushRefused, PushState, PushTable
from pdserve.engine.types.handoff import KVHandoff, KVLayout, KVReservation

NUM_BLOCKS = 8
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")
BLOCK_BYTES = LAYOUT.bytes_per_block  # 2 layers x (k, v) x 4 tokens x 1 head x 4 x 4 bytes = 256
UNBOUNDED = 1 << 40


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(timeout_s: float = 10.0) -> tuple[PushTable, BlockManager, _Clock]:
    manager, clock = BlockManager(NUM_BLOCKS, LAYOUT.block_size), _Clock()
    return PushTable(manager, LAYOUT, timeout_s, clock), manager, clock


def _handoff(request_id: str, num_blocks: int, layout: KVLayout = LAYOUT) -> KVHandoff:
    return KVHandoff(
        request_id=request_id, model_id="m", layout=layout, block_hashes=(), num_tokens=num_blocks * 4 - 1,
        first_token_id=7, transport="grpc", address="127.0.0.1:1", lease_deadline_ms=1, worker_id="p", epoch=1,
    )


def test_a_push_reserves_its_blocks_and_a_request_claims_them_once_landed() -> None:
    table, manager, clock = _table()
    push = table.open("r", LAYOUT, 1, 4, UNBOUNDED)  # block 0 is cached on the decode side: not pushed
    assert push.reservation == KVReservation(1, (0, 1, 2)) and push.state is PushState.ARRIVING
    assert (len(table), table.num_bytes, manager.num_free_blocks) == (1, 3 * BLOCK_BYTES, NUM_BLOCKS - 3)
    clock.now += 1.0
    table.landed(push)
    assert (push.state, push.landed_at, push.expires_at) == (PushState.LANDED, 101.0, 111.0)
    assert table.landed_since(101.0) == 1 and table.landed_since(101.5) == 0
    assert table.claim(_handoff("r", 4)) == KVReservation(1, (0, 1, 2))
    # The request owns the blocks now: the table forgets them and frees nothing.
    assert (len(table), table.num_bytes, manager.num_free_blocks) == (0, 0, NUM_BLOCKS - 3)
    assert not push.dropped and table.claim(_handoff("r", 4)) is None


@pytest.mark.parametrize("state", ["arriving", "broken", "other_layout", "other_size"])
def test_a_claim_drops_a_push_that_cannot_serve_its_handoff(state: str) -> None:
    table, manager, _ = _table()
    push = table.open("r", LAYOUT, 0, 3, UNBOUNDED)
    if state != "arriving":
        table.landed(push)
    if state == "broken":
        table.broken(push)
    handoff = _handoff("r", 3)
    if state == "other_layout":
        handoff = _handoff("r", 3, dataclasses.replace(LAYOUT, dtype="bfloat16"))
    if state == "other_size":
        handoff = _handoff("r", 4)
    assert table.claim(handoff) is None
    assert push.dropped and (len(table), table.num_bytes, manager.num_free_blocks) == (0, 0, NUM_BLOCKS)


def test_a_newer_push_of_the_same_request_replaces_the_older() -> None:
    table, manager, _ = _table()
    older = table.open("r", LAYOUT, 0, 2, UNBOUNDED)
    newer = table.open("r", LAYOUT, 0, 3, UNBOUNDED)
    assert older.dropped and not newer.dropped
    # The older push's blocks went back first, and are taken again first (the last freed first).
    assert newer.reservation.block_ids == (1, 0, 2)
    assert (len(table), table.num_bytes, manager.num_free_blocks) == (1, 3 * BLOCK_BYTES, NUM_BLOCKS - 3)
    # The older stream's end drops only its own push.
    table.drop("r", older)
    assert len(table) == 1 and not newer.dropped


def test_a_push_dropped_before_it_opens_is_refused_until_the_deadline() -> None:
    table, manager, clock = _table(timeout_s=5.0)
    table.drop("r", refuse_later=True)
    with pytest.raises(PushRefused, match="was dropped here") as refused:
        table.open("r", LAYOUT, 0, 2, UNBOUNDED)
    assert refused.value.reason == "dropped" and manager.num_free_blocks == NUM_BLOCKS
    clock.now += 5.0
    assert table.expire() == []
    assert table.open("r", LAYOUT, 0, 2, UNBOUNDED).reservation.block_ids == (0, 1)


def test_pushes_are_refused_past_the_byte_bound_or_the_free_blocks() -> None:
    table, manager, _ = _table()
    table.open("a", LAYOUT, 0, 3, max_bytes=4 * BLOCK_BYTES)
    with pytest.raises(PushRefused, match="over the limit") as over:
        table.open("b", LAYOUT, 0, 2, max_bytes=4 * BLOCK_BYTES)
    assert over.value.reason == "over_limit"
    table.open("b", LAYOUT, 0, 5, UNBOUNDED)
    with pytest.raises(PushRefused, match="no 1 free KV blocks") as no_room:
        table.open("c", LAYOUT, 0, 1, UNBOUNDED)
    assert no_room.value.reason == "no_room" and manager.num_free_blocks == 0 and len(table) == 2


def test_a_push_whose_layout_differs_from_the_engine_is_a_value_error_naming_the_field() -> None:
    table, manager, _ = _table()
    with pytest.raises(ValueError, match="layout.num_kv_heads 2 != this worker's 1"):
        table.open("r", dataclasses.replace(LAYOUT, num_kv_heads=2), 0, 2, UNBOUNDED)
    with pytest.raises(ValueError, match="first_block 2 must be below num_blocks 2"):
        table.open("r", LAYOUT, 2, 2, UNBOUNDED)
    assert manager.num_free_blocks == NUM_BLOCKS


def test_unclaimed_pushes_expire_at_the_handoff_deadline_counted_from_the_open_then_the_landing() -> None:
    table, manager, clock = _table(timeout_s=10.0)
    arriving = table.open("arriving", LAYOUT, 0, 1, UNBOUNDED)  # deadline 110
    clock.now = 105.0
    landed = table.open("landed", LAYOUT, 0, 2, UNBOUNDED)  # deadline 115, then 116 once landed
    clock.now = 106.0
    table.landed(landed)
    clock.now = 110.0
    assert table.expire() == ["arriving"] and arriving.dropped
    clock.now = 115.5
    assert table.expire() == []
    clock.now = 116.0
    assert table.expire() == ["landed"]
    assert (table.num_expired, len(table), table.num_bytes, manager.num_free_blocks) == (2, 0, 0, NUM_BLOCKS)
