from __future__ import annotations

import dataclasses

import pytest
from redis.asyncio import Redis

from pdserve.cluster_index import KeySpace, PrefixIndexLookup, PrefixIndexPublisher, WorkerRegistry
from tests.cluster_index.helpers import make_worker, prompt_hashes

EPOCH_A = 101
EPOCH_B = 202


async def _entries(redis: Redis, prefix: str, block_hashes: list[bytes]) -> list[dict[str, str]]:
    """What Redis holds for each block: worker_id -> epoch."""
    keys = KeySpace(prefix)
    return [
        {field.decode(): value.decode() for field, value in (await redis.hgetall(keys.block(h))).items()}
        for h in block_hashes
    ]


async def _published(redis: Redis, prefix: str, worker_id: str) -> set[str]:
    return {member.decode() for member in await redis.smembers(KeySpace(prefix).worker_blocks(worker_id))}


@pytest.mark.asyncio
async def test_longest_prefix_counts_leading_blocks_per_live_worker(redis_client: Redis, prefix: str) -> None:
    hashes = prompt_hashes(5)
    publisher_a = PrefixIndexPublisher(redis_client, prefix, make_worker("A", epoch=EPOCH_A))
    publisher_b = PrefixIndexPublisher(redis_client, prefix, make_worker("B", epoch=EPOCH_B))
    assert await publisher_a.publish(hashes) is True
    assert await publisher_b.publish([hashes[0], hashes[1], hashes[3]]) is True
    lookup = PrefixIndexLookup(redis_client, prefix)
    live = {"A": EPOCH_A, "B": EPOCH_B, "C": 303}

    assert await lookup.longest_prefix(hashes, live) == {"A": 5, "B": 2, "C": 0}
    assert await lookup.longest_prefix(hashes[:3], live) == {"A": 3, "B": 2, "C": 0}
    # Block 3 alone is useless to B without blocks 0..2 of the same request.
    assert await lookup.longest_prefix(prompt_hashes(5, first_token=100), live) == {"A": 0, "B": 0, "C": 0}
    assert await lookup.longest_prefix([], live) == {"A": 0, "B": 0, "C": 0}


@pytest.mark.asyncio
async def test_removed_block_cuts_the_prefix_at_that_block(redis_client: Redis, prefix: str) -> None:
    hashes = prompt_hashes(5)
    publisher = PrefixIndexPublisher(redis_client, prefix, make_worker("A", epoch=EPOCH_A))
    await publisher.publish(hashes)
    assert await publisher.publish(removed_hashes=[hashes[2]]) is True
    lookup = PrefixIndexLookup(redis_client, prefix)
    assert await lookup.longest_prefix(hashes, {"A": EPOCH_A}) == {"A": 2}
    assert await _entries(redis_client, prefix, [hashes[2]]) == [{}]
    assert await _published(redis_client, prefix, "A") == {h.hex() for i, h in enumerate(hashes) if i != 2}


@pytest.mark.asyncio
async def test_publish_lays_out_keys_with_ttl(redis_client: Redis, prefix: str) -> None:
    hashes = prompt_hashes(2)
    publisher = PrefixIndexPublisher(redis_client, prefix, make_worker("A", epoch=EPOCH_A), block_ttl_s=100)
    await publisher.publish(hashes)
    keys = KeySpace(prefix)
    assert {key.decode() async for key in redis_client.scan_iter(match=keys.pattern)} == {
        f"{prefix}:blk:{hashes[0].hex()}",
        f"{prefix}:blk:{hashes[1].hex()}",
        f"{prefix}:wblk:A",
    }
    assert await _entries(redis_client, prefix, hashes) == [{"A": str(EPOCH_A)}, {"A": str(EPOCH_A)}]
    for key in (keys.block(hashes[0]), keys.block(hashes[1]), keys.worker_blocks("A")):
        assert 99 <= await redis_client.ttl(key) <= 100


@pytest.mark.asyncio
async def test_restarted_worker_old_epoch_is_ignored_and_cleaned_by_lookup(redis_client: Redis, prefix: str) -> None:
    hashes = prompt_hashes(5)
    old_a = make_worker("A", epoch=EPOCH_A)
    await PrefixIndexPublisher(redis_client, prefix, old_a).publish(hashes)
    await PrefixIndexPublisher(redis_client, prefix, make_worker("B", epoch=EPOCH_B)).publish(hashes[:2])
    # A restarted (empty cache) and re-registered under a new epoch.
    new_a = dataclasses.replace(old_a, epoch=EPOCH_A + 1)
    await WorkerRegistry(redis_client, prefix).register(new_a)
    lookup = PrefixIndexLookup(redis_client, prefix)

    assert await lookup.longest_prefix(hashes, {"A": new_a.epoch, "B": EPOCH_B}) == {"A": 0, "B": 2}
    assert await _entries(redis_client, prefix, hashes) == [{"B": str(EPOCH_B)}] * 2 + [{}] * 3
    assert await _published(redis_client, prefix, "A") == set()


@pytest.mark.asyncio
async def test_reset_drops_earlier_epochs_and_clear_drops_own_epoch(redis_client: Redis, prefix: str) -> None:
    hashes = prompt_hashes(4)
    await PrefixIndexPublisher(redis_client, prefix, make_worker("A", epoch=EPOCH_A)).publish(hashes)
    await PrefixIndexPublisher(redis_client, prefix, make_worker("B", epoch=EPOCH_B)).publish(hashes[:1])
    restarted = PrefixIndexPublisher(redis_client, prefix, make_worker("A", epoch=EPOCH_A + 1))

    assert await restarted.reset() is True
    assert await _entries(redis_client, prefix, hashes) == [{"B": str(EPOCH_B)}, {}, {}, {}]
    assert await _published(redis_client, prefix, "A") == set()

    await restarted.publish(hashes[:2])
    # The old process's late clear() must not touch its successor's entries.
    assert await PrefixIndexPublisher(redis_client, prefix, make_worker("A", epoch=EPOCH_A)).clear() is True
    assert await _published(redis_client, prefix, "A") == {hashes[0].hex(), hashes[1].hex()}
    assert await restarted.clear() is True
    assert await _entries(redis_client, prefix, hashes) == [{"B": str(EPOCH_B)}, {}, {}, {}]
    assert await _published(redis_client, prefix, "A") == set()


@pytest.mark.asyncio
async def test_dead_worker_is_ignored_and_cleaned_unless_the_registry_lists_it(redis_client: Redis, prefix: str) -> None:
    hashes = prompt_hashes(3)
    await PrefixIndexPublisher(redis_client, prefix, make_worker("A", epoch=EPOCH_A)).publish(hashes)
    await PrefixIndexPublisher(redis_client, prefix, make_worker("B", epoch=EPOCH_B)).publish(hashes)
    await PrefixIndexPublisher(redis_client, prefix, make_worker("C", epoch=303)).publish(hashes[:1])
    # B is registered (the gateway's live view merely lags); C is gone for good.
    await WorkerRegistry(redis_client, prefix).register(make_worker("B", epoch=EPOCH_B))
    lookup = PrefixIndexLookup(redis_client, prefix)

    assert await lookup.longest_prefix(hashes, {"A": EPOCH_A}) == {"A": 3}
    assert await _entries(redis_client, prefix, hashes) == [{"A": str(EPOCH_A), "B": str(EPOCH_B)}] * 3
    assert await _published(redis_client, prefix, "C") == set()


@pytest.mark.asyncio
async def test_resync_makes_entries_exactly_the_cached_hashes(redis_client: Redis, prefix: str) -> None:
    hashes = prompt_hashes(5)
    publisher = PrefixIndexPublisher(redis_client, prefix, make_worker("A", epoch=EPOCH_A))
    await publisher.publish(hashes[:4])
    assert await publisher.resync([hashes[0], hashes[1], hashes[4]]) is True
    assert await _published(redis_client, prefix, "A") == {hashes[i].hex() for i in (0, 1, 4)}
    expected = {"A": str(EPOCH_A)}
    assert await _entries(redis_client, prefix, hashes) == [expected, expected, {}, {}, expected]
    assert (publisher.in_sync, publisher.num_dropped_events) == (True, 0)


@pytest.mark.asyncio
async def test_publish_rejects_a_hash_both_stored_and_removed(redis_client: Redis, prefix: str) -> None:
    hashes = prompt_hashes(1)
    publisher = PrefixIndexPublisher(redis_client, prefix, make_worker("A"))
    with pytest.raises(ValueError, match="both stored and removed"):
        await publisher.publish(hashes, hashes)
