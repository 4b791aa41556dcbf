"""The gateway's routing decisions on hand-made worker states (no servers, no Redis)."""

from __future__ import annotations

import pytest

from pdserve.gateway.router import NoWorkerAvailable, RecentPrefills, Router
from pdserve.gateway.workers import WorkerHandle, WorkerPool
from pdserve.protos.pdserve.v1.internal import worker_pb2


class _FakeLookup:
    """Stands in for the Redis index: a fixed number of cached leading blocks per worker id."""

    def __init__(self, blocks: dict[str, int]) -> None:
        self.blocks = blocks
        self.calls: list[dict[str, int]] = []

    async def longest_prefix(self, block_hashes: list[bytes], live: dict[str, int]) -> dict[str, int]:
        self.calls.append(dict(live))
        return {worker: self.blocks.get(worker, 0) for worker in live}


def _pool(workers: list[tuple[str, str, int, int, int]]) -> WorkerPool:
    """(role, worker_id, queued_tokens, running, free_blocks) per worker."""
    pool = WorkerPool([], [])
    for index, (role, worker_id, queued, running, free) in enumerate(workers):
        report = worker_pb2.LoadReport(
            worker_id=worker_id, role=role, epoch=index + 1, num_queued_tokens=queued, num_running=running,
            num_free_blocks=free, block_size=16, model_id="m",
        )
        pool.workers[f"{role}@{worker_id}"] = WorkerHandle(
            address=f"127.0.0.1:{index + 1}", role=role, channel=None, stub=None, report=report, healthy=True  # type: ignore[arg-type]
        )
    return pool


@pytest.mark.asyncio
async def test_prefill_goes_to_the_worker_holding_the_prefix_when_queues_are_equal() -> None:
    pool = _pool([("prefill", "a", 0, 0, 100), ("prefill", "b", 0, 0, 100)])
    lookup = _FakeLookup({"b": 6})
    choice = await Router(pool, lookup).choose_prefill(list(range(100)))  # type: ignore[arg-type]
    assert (choice.worker.worker_id, choice.expected_cached_tokens) == ("b", 96)
    assert lookup.calls == [{"a": 1, "b": 2}]


@pytest.mark.asyncio
async def test_a_long_queue_outweighs_a_cached_prefix() -> None:
    # b caches 96 of 100 tokens (4 to compute) but has 200 queued; a computes 100 with nothing queued.
    pool = _pool([("prefill", "a", 0, 0, 100), ("prefill", "b", 200, 0, 100)])
    choice = await Router(pool, _FakeLookup({"b": 6})).choose_prefill(list(range(100)))  # type: ignore[arg-type]
    assert choice.worker.worker_id == "a"


@pytest.mark.asyncio
async def test_a_fully_cached_prompt_still_counts_its_last_block_as_work() -> None:
    pool = _pool([("prefill", "a", 0, 0, 100)])
    choice = await Router(pool, _FakeLookup({"a": 2})).choose_prefill(list(range(32)))  # type: ignore[arg-type]
    assert choice.expected_cached_tokens == 16


@pytest.mark.asyncio
async def test_round_robin_ignores_caches_and_load() -> None:
    pool = _pool([("prefill", "a", 500, 0, 100), ("prefill", "b", 0, 0, 100), ("decode", "d", 0, 0, 100)])
    router = Router(pool, _FakeLookup({"a": 6}), policy="round_robin")  # type: ignore[arg-type]
    picks = []
    for _ in range(4):
        # As the gateway does: a prefill and a decode choice per request.
        picks.append((await router.choose_prefill(list(range(100)))).worker.worker_id)
        router.choose_decode()
    assert picks == ["a", "b", "a", "b"]


def test_decode_prefers_fewer_running_then_more_free_blocks() -> None:
    pool = _pool([("decode", "x", 0, 3, 900), ("decode", "y", 0, 1, 100), ("decode", "z", 0, 1, 500)])
    assert Router(pool, None).choose_decode().worker_id == "z"


@pytest.mark.asyncio
async def test_no_healthy_worker_raises() -> None:
    pool = _pool([("prefill", "a", 0, 0, 100)])
    pool.workers["prefill@a"].healthy = False
    with pytest.raises(NoWorkerAvailable):
        await Router(pool, None).choose_prefill([1, 2, 3])
    with pytest.raises(NoWorkerAvailable):
        Router(pool, None).choose_decode()
    with pytest.raises(ValueError, match="routing policy"):
        Router(pool, None, policy="random")


@pytest.mark.asyncio
async def test_a_prompt_just_prefilled_draws_its_followers_before_the_index_has_it() -> None:
    # The index knows nothing yet (the worker has not published): without the router's own
    # memory the followers would alternate between a and b on the round-robin tie-break.
    pool = _pool([("prefill", "a", 0, 0, 100), ("prefill", "b", 0, 0, 100)])
    router = Router(pool, _FakeLookup({}))  # type: ignore[arg-type]
    prompt = list(range(100))
    first = await router.choose_prefill(prompt)
    assert (first.expected_cached_tokens, len(first.block_hashes)) == (0, 6)
    router.prefilled(first)
    followers = [await router.choose_prefill(prompt) for _ in range(3)]
    assert [(c.worker.worker_id, c.expected_cached_tokens) for c in followers] == [(first.worker.worker_id, 96)] * 3
    # Another prompt sharing only the first block: one block's worth.
    other = await router.choose_prefill(list(range(16)) + [500] * 40)
    assert (other.worker.worker_id, other.expected_cached_tokens) == (first.worker.worker_id, 16)


def test_recent_prefills_expire_count_leading_blocks_only_and_are_bounded() -> None:
    now = [100.0]
    recent = RecentPrefills(ttl_s=10.0, max_blocks=4, clock=lambda: now[0])
    h = [bytes([i]) for i in range(6)]
    recent.add("a", 1, h[:3])
    assert recent.longest_prefix(h, {"a": 1, "b": 1}) == {"a": 3}
    assert recent.longest_prefix([h[0], h[5], h[1]], {"a": 1}) == {"a": 1}  # the leading run only
    assert recent.longest_prefix(h, {"a": 2}) == {}  # a restarted worker holds nothing of its past self
    now[0] = 105.0
    recent.add("b", 1, h[:2])  # 5 blocks in all: a's oldest block goes
    assert recent.longest_prefix(h, {"a": 1, "b": 1}) == {"b": 2}
    assert recent.longest_prefix(h[1:], {"a": 1}) == {"a": 2}
    now[0] = 110.0  # a's entries expire; b's (added at 105) do not
    assert recent.longest_prefix(h, {"a": 1, "b": 1}) == {"b": 2}
    assert recent.longest_prefix(h[1:], {"a": 1}) == {}


def _hold(pool: WorkerPool, worker_id: str, *adapters: str) -> None:
    next(w for w in pool.workers.values() if w.worker_id == worker_id).report.lora_adapters.extend(adapters)  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_an_adapter_request_prefers_the_workers_holding_it_while_load_and_prefix_hits_still_count() -> None:
    pool = _pool([("prefill", "a", 0, 0, 100), ("prefill", "b", 0, 0, 100),
                  ("decode", "c", 0, 1, 100), ("decode", "d", 0, 2, 100)])
    _hold(pool, "b", "sql")
    _hold(pool, "d", "sql")
    router = Router(pool, _FakeLookup({}))  # type: ignore[arg-type]
    # Equal queues: the adapter decides. The base model ignores adapters.
    assert (await router.choose_prefill(list(range(100)), lora_name="sql")).worker.worker_id == "b"
    assert router.choose_decode("sql").worker_id == "d"  # 2 running beats 1 running + LORA_MISS_RUNNING
    assert router.choose_decode().worker_id == "c"
    # A worker without it that is more than LORA_MISS_TOKENS tokens less loaded still wins.
    next(w for w in pool.workers.values() if w.worker_id == "b").report.num_queued_tokens = 65  # type: ignore[union-attr]
    assert (await router.choose_prefill(list(range(100)), lora_name="sql")).worker.worker_id == "a"
    # A prefix cached under the adapter (on a) outweighs holding it (b, 65 queued).
    router = Router(pool, _FakeLookup({"a": 4}))  # type: ignore[arg-type]
    choice = await router.choose_prefill(list(range(100)), lora_name="sql")
    assert (choice.worker.worker_id, choice.expected_cached_tokens) == ("a", 64)


def test_an_adapters_blocks_hash_apart_from_the_bases_and_other_adapters() -> None:
    from pdserve.engine.types.hashing import adapter_model_id, hash_prompt_blocks

    tokens = list(range(32))
    hashes = {name: hash_prompt_blocks(tokens, 16, adapter_model_id("m", name)) for name in (None, "a", "b")}
    assert adapter_model_id("m", None) == adapter_model_id("m", "") == "m"
    assert adapter_model_id("m", "a") == "m+lora:a"
    assert len({tuple(h) for h in hashes.values()}) == 3 and all(len(h) == 2 for h in hashes.values())
