"""KV pushed to the decode worker while the prefill runs, through real gRPC servers: exact, and nothing leaks."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import grpc
import pytest

from pdserve.decode_service.server import DecodeServer
from pdserve.engine.kv.connector import PushRefused, PushTable
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from tests.conftest import Oracle, StartInProcessCluster, random_prompts
from tests.support.cluster import ClusterOptions, InProcessCluster
from tests.support.waiting import wait_until

MAX_TOKENS = 12
PARAMS = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHM_PREFIX = "pdserve_kv_"


def _request(prompt: list[int]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=PARAMS)


def _tokens(responses: list[generation_pb2.GenerateResponse]) -> list[int]:
    return [token for response in responses for token in response.token_ids]


def _shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)}


def _pushes(decode: DecodeServer) -> PushTable:
    """What pushes hold on ``decode``: its engine's KV connector owns them."""
    return decode.runtime.engine.kv_connector.pushes


async def _assert_nothing_held(cluster: InProcessCluster) -> None:
    """Every block free on every worker, no lease, no push in flight, nothing in any inbox."""
    reports = await cluster.wait_idle()
    assert [r.num_free_blocks for r in reports] == [r.num_total_blocks for r in reports]
    for prefill in cluster.prefills:
        await wait_until(lambda p=prefill: not p.runtime.engine.leases.request_ids, "every lease released")
        assert prefill.servicer.pusher._pushes == {}
        assert prefill.servicer.pusher._queued_bytes == 0
    for decode in cluster.decodes:
        await wait_until(lambda d=decode: len(_pushes(d)) == 0, "every pushed KV claimed or dropped")
        assert _pushes(decode).num_bytes == 0 and decode.servicer.inbox.num_receiving == 0
        assert len(decode.servicer.early) == 0  # every request started on its push was claimed or ended


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_pushed_kv_gives_transformers_tokens_over_each_cpu_transport(
    transport: str, llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    segments_before = _shm_segments()
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256, kv_transport=transport))
    # Lengths around block edges (16), one token, and prompts sent together so steps batch them.
    prompts = random_prompts([1, 15, 16, 17, 40, 95, 160, 300], seed=130)
    results = await asyncio.gather(*(cluster.generate(_request(prompt)) for prompt in prompts))
    oracle = Oracle(llama_checkpoint)
    for prompt, responses in zip(prompts, results):
        assert _tokens(responses) == oracle.generate(prompt, MAX_TOKENS)
    # Every handoff came by push: none fetched, none recomputed.
    report = (await cluster.loads())[1]
    assert (report.kv_pushes, report.kv_transfers, report.kv_recomputes) == (len(prompts), len(prompts), 0)
    assert cluster.prefill.servicer.pusher.num_pushed == len(prompts)
    assert cluster.prefill.servicer.pusher.num_failed == 0
    # Each request started on the decode worker when its push completed; its Decode attached to it.
    early = cluster.decode.servicer.early
    assert (early.num_started, early.num_claimed, early.num_ended) == (len(prompts), len(prompts), 0)
    await _assert_nothing_held(cluster)
    assert _shm_segments() == segments_before


@pytest.mark.asyncio
async def test_with_push_off_the_decode_worker_pulls_and_the_tokens_are_the_same(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(gateway_args={"kv_push": False}))
    prompts = random_prompts([40, 95], seed=131)
    results = [await cluster.generate(_request(prompt)) for prompt in prompts]
    oracle = Oracle(llama_checkpoint)
    assert [_tokens(r) for r in results] == [oracle.generate(p, MAX_TOKENS) for p in prompts]
    report = (await cluster.loads())[1]
    assert (report.kv_pushes, report.kv_transfers) == (0, 2)
    await _assert_nothing_held(cluster)


class _HoldPrefillAtLayer:
    """Blocks the prefill engine thread after it pushed layer ``layer``, until ``release`` is set.

    Wraps the prefill service's pusher (the engine's sink), so the push has started and
    the decode worker holds part of the KV while the prefill is held mid-forward.
    """

    def __init__(self, sink: object, layer: int) -> None:
        self._sink = sink
        self._layer = layer
        self.reached = threading.Event()
        self.release = threading.Event()

    def push_layer(self, request_id, layer, first_block, blocks) -> None:  # noqa: ANN001
        self._sink.push_layer(request_id, layer, first_block, blocks)
        if layer == self._layer and not self.release.is_set():
            self.reached.set()
            self.release.wait(timeout=30)

    def push_end(self, request_id: str, complete: bool) -> None:
        self._sink.push_end(request_id, complete)


async def _wait_for_push_started(cluster: InProcessCluster) -> None:
    await wait_until(lambda: any(len(_pushes(d)) for d in cluster.decodes), "a push to reach a decode worker")


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_pushed_kv_is_written_into_blocks_reserved_while_the_prefill_runs_and_the_claim_copies_none(
    transport: str, llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(kv_transport=transport))
    engine = cluster.prefill.runtime.engine
    hold = _HoldPrefillAtLayer(engine.kv_pusher.sink, layer=1)
    engine.kv_pusher.sink = hold
    decode_engine = cluster.decode.runtime.engine
    claimed_blocks: list[int] = []
    landed_at_once: list[tuple[str, int]] = []
    connector = decode_engine.kv_connector
    fill, join_if_present = connector.fill, connector.scheduler.join_if_present

    def recording_fill(request_id, first_block, blocks):  # noqa: ANN001, ANN202 - wraps the connector's
        claimed_blocks.append(blocks.shape[2])
        return fill(request_id, first_block, blocks)

    def recording_join_if_present(slot):  # noqa: ANN001, ANN202 - wraps the connector's
        output = join_if_present(slot)
        landed_at_once.append((slot.request_id, slot.first_block if output is not None else -1))
        return output

    connector.fill = recording_fill
    connector.scheduler.join_if_present = recording_join_if_present
    prompt = random_prompts([200], seed=136)[0]
    num_blocks = -(-len(prompt) // decode_engine.block_size)
    generation = asyncio.create_task(cluster.generate(_request(prompt)))
    try:
        assert await asyncio.to_thread(hold.reached.wait, 30)
        await _wait_for_push_started(cluster)
        # Mid-prefill, the decode engine already holds a block for every block of the prompt.
        free = await cluster.decode.runtime.async_engine.call(lambda e: e.block_manager.num_free_blocks)
        assert decode_engine.block_manager.num_blocks - free == num_blocks
    finally:
        hold.release.set()
    responses = await generation
    assert _tokens(responses) == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    # The request adopted those blocks: its KV landed with no block left to copy, as its blocks were
    # allocated, without a trip to the decode service (which would cost it a step under load).
    assert claimed_blocks == []
    assert landed_at_once == [(f"{responses[0].request_id}/decode", num_blocks)]
    assert cluster.decode.servicer.kv_pushes == 1
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_blocks_the_decode_worker_caches_are_not_pushed(
    transport: str, llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(num_kv_blocks=128, redis=True, kv_transport=transport)
    )
    assert cluster.gateway is not None
    router = cluster.gateway.servicer.router
    (decode_handle,) = router.pool.healthy("decode")
    block_size = cluster.decode.runtime.engine.block_size
    layout = cluster.decode.runtime.engine.kv_layout
    first, second = random_prompts([100, 60], seed=137)
    second = first[:96] + second  # shares the first 6 blocks of 16 tokens
    oracle = Oracle(llama_checkpoint)
    assert _tokens(await cluster.generate(_request(first))) == oracle.generate(first, MAX_TOKENS)
    # The decode worker cached the first prompt's 6 full blocks, and the index says so.
    await wait_until(lambda: router.decode_cached_tokens(decode_handle, second), "the decode worker's blocks indexed",
                     until=lambda cached: cached == 96)
    bytes_before = cluster.decode.servicer.kv_bytes_received
    assert _tokens(await cluster.generate(_request(second))) == oracle.generate(second, MAX_TOKENS)
    # Of the second prompt's 10 blocks, only the 4 past the cached prefix travelled.
    num_blocks = -(-len(second) // block_size)
    assert num_blocks == 10
    assert cluster.decode.servicer.kv_bytes_received - bytes_before == 4 * layout.bytes_per_block
    report = (await cluster.loads())[1]
    assert (report.kv_pushes, report.kv_transfers, report.kv_recomputes) == (2, 2, 0)
    assert cluster.prefill.servicer.pusher.num_pushed == 2
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
async def test_a_decode_worker_without_free_blocks_for_a_push_refuses_it_and_the_kv_is_pulled(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint)
    decode_engine = cluster.decode.runtime.engine
    asked: list[int] = []

    def no_room(request_id, layout, first_block, num_blocks, max_bytes):  # noqa: ANN001, ANN202 - a full pool
        asked.append(num_blocks - first_block)
        raise PushRefused("no_room", f"no {num_blocks - first_block} free KV blocks here for the push")

    decode_engine.kv_connector.open_push = no_room
    prompt = random_prompts([70], seed=138)[0]
    assert _tokens(await cluster.generate(_request(prompt))) == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    assert asked == [5]  # 70 tokens: 5 blocks of 16
    assert cluster.prefill.servicer.pusher.num_failed == 1 and cluster.prefill.servicer.pusher.num_pushed == 0
    report = (await cluster.loads())[1]
    assert (report.kv_pushes, report.kv_transfers, report.kv_recomputes) == (0, 1, 0)
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
async def test_client_cancel_during_the_push_frees_everything_on_both_sides(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    segments_before = _shm_segments()
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(kv_transport="shm"))
    engine = cluster.prefill.runtime.engine
    hold = _HoldPrefillAtLayer(engine.kv_pusher.sink, layer=1)
    engine.kv_pusher.sink = hold
    assert cluster.stub is not None
    call = cluster.stub.Generate(_request(random_prompts([200], seed=132)[0]), timeout=30)
    try:
        assert await asyncio.to_thread(hold.reached.wait, 30)
        await _wait_for_push_started(cluster)
        call.cancel()
    finally:
        hold.release.set()
    assert await call.code() == grpc.StatusCode.CANCELLED
    await _assert_nothing_held(cluster)
    assert cluster.prefill.servicer.pusher.num_pushed == 0
    assert _shm_segments() == segments_before
    # The cluster still serves, by push.
    engine.kv_pusher.sink = cluster.prefill.servicer.pusher
    prompt = random_prompts([50], seed=133)[0]
    assert _tokens(await cluster.generate(_request(prompt))) == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_decode_worker_dying_while_kv_is_pushed_to_it_falls_back_to_another_by_pull(
    transport: str, llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    segments_before = _shm_segments()
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(decode_workers=2, kv_transport=transport)
    )
    engine = cluster.prefill.runtime.engine
    hold = _HoldPrefillAtLayer(engine.kv_pusher.sink, layer=1)
    engine.kv_pusher.sink = hold
    prompt = random_prompts([200], seed=134)[0]
    generation = asyncio.create_task(cluster.generate(_request(prompt)))
    try:
        assert await asyncio.to_thread(hold.reached.wait, 30)
        await _wait_for_push_started(cluster)
        (victim,) = [d for d in cluster.decodes if len(_pushes(d))]
        # The decode worker goes away mid-push: its server stops at once, cancelling every call.
        await victim.server.grpc_server.stop(0)
    finally:
        hold.release.set()
    responses = await generation
    assert _tokens(responses) == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    (survivor,) = [d for d in cluster.decodes if d is not victim]
    report = survivor.servicer
    # The survivor pulled the KV the prefill worker still held under its lease.
    assert (report.kv_pushes, report.kv_transfers, report.kv_recomputes) == (0, 1, 0)
    assert cluster.prefill.servicer.pusher.num_pushed == 0
    await wait_until(lambda: not engine.leases.request_ids, "the lease released")
    assert cluster.prefill.servicer.pusher._pushes == {}
    await wait_until(lambda: len(_pushes(victim)) == 0, "the victim's half push dropped")
    assert _pushes(victim).num_bytes == 0
    assert len(_pushes(survivor)) == 0
    assert _shm_segments() == segments_before

    def all_free() -> bool:
        workers = (cluster.prefill, survivor)
        return all(w.runtime.async_engine.latest_stats.num_free_blocks == w.runtime.async_engine.latest_stats.num_total_blocks
                   for w in workers)

    await wait_until(all_free, "every block free on the prefill worker and the surviving decode worker")


class _PushTargetMarkedDown:
    """Marks the decode worker a push completed on unhealthy in the gateway (a missed load poll) before
    the prefill worker answers, and holds the other decode worker's pulls until ``fetch_may_go``.

    ``confirmed``: what the prefill worker says of the push (False: its confirmation came too late).
    """

    def __init__(self, cluster: InProcessCluster, confirmed: bool) -> None:
        assert cluster.gateway is not None and len(cluster.decodes) == 2
        self.cluster, self.confirmed = cluster, confirmed
        self.target: DecodeServer | None = None
        self.fetching, self.fetch_may_go = asyncio.Event(), asyncio.Event()
        pusher = cluster.prefill.servicer.pusher
        self._finish = pusher.finish
        pusher.finish = self._finish_and_mark_down

    @property
    def other(self) -> DecodeServer:
        (other,) = [d for d in self.cluster.decodes if d is not self.target]
        return other

    async def _finish_and_mark_down(self, request_id: str, timeout_s: float, start: object = None) -> bool:
        assert await self._finish(request_id, timeout_s, start)
        (self.target,) = [d for d in self.cluster.decodes if d.servicer.early.num_started]
        address = self.cluster.decode_addresses[self.cluster.decodes.index(self.target)]
        assert self.cluster.gateway is not None
        self.cluster.gateway.pool.workers[f"decode@{address}"].healthy = False
        fetch = self.other.servicer._fetch

        async def held_fetch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - wraps the servicer's
            self.fetching.set()
            await self.fetch_may_go.wait()
            return await fetch(*args, **kwargs)

        self.other.servicer._fetch = held_fetch
        return self.confirmed


def _two_decode_workers_never_polled() -> ClusterOptions:
    # Polls are off (one an hour): none marks a worker healthy again behind the test's back.
    return ClusterOptions(decode_workers=2, num_kv_blocks=256, gateway_args={"poll_s": 3600.0})


@pytest.mark.asyncio
async def test_a_completed_push_is_decoded_where_it_landed_though_the_gateway_marked_that_worker_down(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # The push completing shows the worker answers: the request it started there is claimed (which lets
    # the prefill worker's lease go), nothing is pulled or recomputed.
    cluster = await start_inprocess_cluster(llama_checkpoint, _two_decode_workers_never_polled())
    marked = _PushTargetMarkedDown(cluster, confirmed=True)
    prompt = random_prompts([90], seed=136)[0]
    assert _tokens(await cluster.generate(_request(prompt))) == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    assert marked.target is not None
    early = marked.target.servicer.early
    assert (early.num_started, early.num_claimed, early.num_ended) == (1, 1, 0)
    assert (marked.target.servicer.kv_pushes, marked.target.servicer.kv_recomputes) == (1, 0)
    assert not marked.fetching.is_set() and marked.other.servicer.kv_transfers == 0
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
async def test_a_request_served_off_its_push_target_ends_what_the_push_started_there_at_the_switch(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # The push completed but the prefill worker heard too late (kv_pushed=false, lease kept) and the
    # gateway has the push target down: the other decode worker pulls (the request the push started
    # keeps the lease until claimed) and serves the request. What the push started on the target ends
    # when the gateway switches, while the request runs elsewhere, not when it ends there: no tokens
    # computed for nobody meanwhile.
    cluster = await start_inprocess_cluster(llama_checkpoint, _two_decode_workers_never_polled())
    marked = _PushTargetMarkedDown(cluster, confirmed=False)
    max_tokens = 40
    params = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = random_prompts([90], seed=136)[0]
    generation = asyncio.create_task(
        cluster.generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params))
    )
    try:
        await asyncio.wait_for(marked.fetching.wait(), 30)
        assert marked.target is not None
        target = marked.target
        early = target.servicer.early

        def target_let_go() -> bool:
            stats = target.runtime.async_engine.latest_stats
            return (len(early) == 0 and len(_pushes(target)) == 0
                    and stats.num_free_blocks == stats.num_total_blocks)

        await wait_until(target_let_go, "the push target to end what the push started while the request runs elsewhere")
        assert not generation.done()
        assert (early.num_started, early.num_claimed, early.num_ended) == (1, 0, 1)
    finally:
        marked.fetch_may_go.set()
    assert _tokens(await generation) == Oracle(llama_checkpoint).generate(prompt, max_tokens)
    other = marked.other.servicer
    assert (other.kv_pushes, other.kv_transfers, other.kv_recomputes) == (0, 1, 0)
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
async def test_prefill_worker_dying_mid_push_leaves_nothing_on_the_decode_worker_and_the_request_is_retried(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(prefill_workers=2))
    holds = []
    for prefill in cluster.prefills:
        engine = prefill.runtime.engine
        holds.append(_HoldPrefillAtLayer(engine.kv_pusher.sink, layer=1))
        engine.kv_pusher.sink = holds[-1]
    prompt = random_prompts([200], seed=135)[0]
    generation = asyncio.create_task(cluster.generate(_request(prompt)))
    try:
        await wait_until(lambda: any(h.reached.is_set() for h in holds), "a prefill worker to push a layer")
        await _wait_for_push_started(cluster)
        (index,) = [i for i, h in enumerate(holds) if h.reached.is_set()]
        victim = cluster.prefills[index]
        # The prefill worker goes away mid-push: every call it serves or makes ends.
        await victim.server.grpc_server.stop(0)
    finally:
        for hold in holds:
            hold.release.set()
    responses = await generation
    assert _tokens(responses) == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    (survivor,) = [p for p in cluster.prefills if p is not victim]
    assert cluster.gateway is not None
    registry = cluster.gateway.servicer.metrics.registry
    assert [registry.get_sample_value("pdserve_gateway_worker_retries_total", {"role": role})
            for role in ("prefill", "decode")] == [1.0, 0.0]
    # The retry on the other prefill worker pushed to the same decode worker, which took that push.
    assert survivor.servicer.pusher.num_pushed == 1
    assert cluster.decode.servicer.kv_pushes == 1
    assert len(_pushes(cluster.decode)) == 0 and _pushes(cluster.decode).num_bytes == 0
    await wait_until(lambda: victim.runtime.async_engine.latest_stats.num_free_blocks
                     == victim.runtime.async_engine.latest_stats.num_total_blocks, "the dead prefill's blocks freed")
    assert victim.servicer.pusher._pushes == {}
    await wait_until(lambda: not survivor.runtime.engine.leases.request_ids, "the lease released")


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_a_request_the_first_token_ends_has_its_pushed_kv_dropped_at_once_not_at_expiry(
    transport: str, llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # The prefill worker pushes while it computes; its first token is a stop token, so no Decode
    # ever claims the push: the prefill worker cancels it, and the decode worker drops it, freeing its
    # blocks now.
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256, kv_transport=transport))
    prompt = random_prompts([90], seed=134)[0]
    first_token = Oracle(llama_checkpoint).generate(prompt, 1)[0]
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[first_token])
    responses = await cluster.generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params))
    assert _tokens(responses) == [first_token]
    assert responses[-1].finish_reason == generation_pb2.FINISH_REASON_STOP
    pushes = _pushes(cluster.decode)
    await wait_until(lambda: len(pushes) == 0, "the unclaimed push dropped", timeout_s=5.0)
    assert (pushes.num_expired, pushes.num_bytes) == (0, 0)
    report = (await cluster.loads())[1]
    assert (report.kv_pushes, report.num_free_blocks) == (0, report.num_total_blocks)
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
async def test_a_push_arriving_after_its_request_was_dropped_is_refused_and_the_kv_pulled(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # A DropPush can overtake the push it drops (two connections): the push that opens afterwards is
    # refused, so nothing holds decode blocks until expiry. Here the drop comes first.
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256))
    await _decode_stub(cluster).DropPush(worker_pb2.DropPushRequest(request_id="dropped-early"), timeout=5)
    prompt = random_prompts([70], seed=135)[0]
    request = generation_pb2.GenerateRequest(request_id="dropped-early", prompt_token_ids=prompt, sampling_params=PARAMS)
    assert _tokens(await cluster.generate(request)) == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    report = (await cluster.loads())[1]
    assert (report.kv_pushes, report.kv_transfers, report.kv_recomputes) == (0, 1, 0)
    assert cluster.prefill.servicer.pusher.num_failed == 1
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
async def test_a_drop_that_comes_while_the_push_reserves_its_blocks_frees_them_at_once(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # The DropPush comes while the push reserves its blocks: the push must not hold them afterwards, or
    # they stay held until expiry (the soak test caught 12 such blocks).
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256))
    inbox = cluster.decode.servicer.inbox
    open_push = inbox.landing.open
    reserved = []

    async def reserve_then_dropped(request_id, layout, first_block: int, num_blocks: int):  # noqa: ANN001, ANN202
        push = await open_push(request_id, layout, first_block, num_blocks)
        reserved.append(push.reservation)
        await _decode_stub(cluster).DropPush(worker_pb2.DropPushRequest(request_id=request_id), timeout=5)
        return push

    inbox.landing.open = reserve_then_dropped
    prompt = random_prompts([70], seed=136)[0]
    request = generation_pb2.GenerateRequest(
        request_id="dropped-while-reserving", prompt_token_ids=prompt, sampling_params=PARAMS
    )
    # The refused push is pulled instead: the output is unchanged.
    assert _tokens(await cluster.generate(request)) == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    pushes = _pushes(cluster.decode)
    assert len(reserved) == 1 and reserved[0] is not None
    assert (len(pushes), pushes.num_bytes, pushes.num_expired) == (0, 0, 0)
    report = (await cluster.loads())[1]
    assert (report.kv_pushes, report.kv_transfers, report.kv_recomputes) == (0, 1, 0)
    assert cluster.prefill.servicer.pusher.num_failed == 1
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
@pytest.mark.parametrize("with_start", [True, False])
async def test_a_push_confirmed_too_late_for_the_prefill_worker_is_used_or_dropped_when_the_request_pulls(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster, with_start: bool
) -> None:
    # The decode worker completed the push, but its confirmation reached the prefill worker after the
    # wait for it ended: the prefill worker answers kv_pushed=false and the gateway's Decode says "pull".
    # With the push's start (as prefill workers send it) the request runs already, and the Decode
    # attaches to it: nothing is pulled. Without one, the request pulls, and the complete push must
    # not sit in the inbox until expiry.
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256))
    pushes = _pushes(cluster.decode)
    pusher = cluster.prefill.servicer.pusher
    finish = pusher.finish

    async def confirmed_too_late(request_id: str, timeout_s: float, start: object = None) -> bool:
        assert start is not None  # the prefill service always announces the Decode
        assert await finish(request_id, timeout_s, start if with_start else None)
        return False

    pusher.finish = confirmed_too_late
    prompt = random_prompts([70], seed=137)[0]
    request = generation_pb2.GenerateRequest(request_id="confirmed-late", prompt_token_ids=prompt, sampling_params=PARAMS)
    assert _tokens(await cluster.generate(request)) == Oracle(llama_checkpoint).generate(prompt, MAX_TOKENS)
    report = (await cluster.loads())[1]
    early = cluster.decode.servicer.early
    if with_start:
        assert (report.kv_pushes, report.kv_transfers, report.kv_recomputes) == (1, 1, 0)
        assert (early.num_started, early.num_claimed, early.num_ended) == (1, 1, 0)
    else:
        assert (report.kv_pushes, report.kv_transfers, report.kv_recomputes) == (0, 1, 0)
        assert early.num_started == 0
    await wait_until(lambda: len(pushes) == 0, "the unclaimed push dropped", timeout_s=5.0)
    assert (pushes.num_bytes, pushes.num_expired) == (0, 0)
    await _assert_nothing_held(cluster)


async def _prefill_pushed(cluster: InProcessCluster, request_id: str, prompt: list[int]) -> worker_pb2.PrefillResponse:
    """What the gateway does before its Decode: a prefill that pushes to the decode worker."""
    stub = _prefill_stub(cluster)
    request = worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=PARAMS,
                                        transport="grpc", push_address=cluster.decode_addresses[0])
    response = await stub.Prefill(request, timeout=30)
    assert response.kv_pushed
    return response


def _prefill_stub(cluster: InProcessCluster) -> worker_pb2_grpc.PrefillWorkerStub:
    stub = cluster.worker_stubs[0]  # the prefill worker's, then the decode worker's
    assert isinstance(stub, worker_pb2_grpc.PrefillWorkerStub)
    return stub


def _decode_stub(cluster: InProcessCluster) -> worker_pb2_grpc.DecodeWorkerStub:
    stub = cluster.worker_stubs[1]  # the prefill worker's, then the decode worker's
    assert isinstance(stub, worker_pb2_grpc.DecodeWorkerStub)
    return stub


@pytest.mark.asyncio
@pytest.mark.parametrize("ending", ["expiry", "drop_push"])
async def test_a_request_started_on_its_push_ends_when_no_decode_claims_it(
    ending: str, llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # The Decode never comes here (the gateway died, or sent it to another decode worker, which sent
    # DropPush): the request the push started ends and its blocks are freed. The expiry lets go of the
    # prefill worker's lease too; after a DropPush the decode worker serving the request does.
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256, gateway=False))
    early = cluster.decode.servicer.early
    early.timeout_s = 0.3 if ending == "expiry" else 600.0
    await _prefill_pushed(cluster, "unclaimed", random_prompts([70], seed=141)[0])
    assert early.num_started == 1
    if ending == "drop_push":
        await _decode_stub(cluster).DropPush(worker_pb2.DropPushRequest(request_id="unclaimed"), timeout=5)
    await wait_until(lambda: early.num_ended == 1, f"the early request ended by {ending}")
    assert (len(early), early.num_claimed) == (0, 0)
    if ending == "drop_push":
        assert cluster.prefill.runtime.engine.leases.request_ids == ["unclaimed"]
        await _prefill_stub(cluster).ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="unclaimed"), timeout=5)
    await _assert_nothing_held(cluster)
    assert not cluster.decode.runtime.engine.has_unfinished_requests()


@pytest.mark.asyncio
async def test_a_decode_that_differs_from_its_push_start_restarts_the_request_with_its_own_parameters(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256, gateway=False))
    prompt = random_prompts([70], seed=142)[0]
    response = await _prefill_pushed(cluster, "differs", prompt)
    decode_stub = _decode_stub(cluster)
    fewer = generation_pb2.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    request = worker_pb2.DecodeRequest(request_id="differs", prompt_token_ids=prompt, sampling_params=fewer,
                                       handoff=response.handoff, kv_pushed=True)
    tokens = [response.first_token_id]
    async for piece in decode_stub.Decode(request, timeout=30):
        tokens.extend(piece.token_ids)
    assert tokens == Oracle(llama_checkpoint).generate(prompt, 5)
    early = cluster.decode.servicer.early
    assert (early.num_started, early.num_claimed, early.num_ended) == (1, 0, 1)
    # The restarted request pulled the prompt's KV (the early one had taken the push), not recomputed it:
    # the prefill worker's lease outlives an early start until its Decode claims it.
    servicer = cluster.decode.servicer
    assert (servicer.kv_pushes, servicer.kv_transfers, servicer.kv_recomputes) == (1, 2, 0)
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
async def test_one_handoff_deadline_bounds_the_lease_the_pushed_kv_and_the_early_start(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(num_kv_blocks=256, gateway=False, kv_handoff_timeout_s=7.5)
    )
    assert cluster.prefill.runtime.engine.leases.timeout_s == 7.5
    assert _pushes(cluster.decode).timeout_s == 7.5
    assert cluster.decode.servicer.early.timeout_s == 7.5


@pytest.mark.asyncio
async def test_a_complete_push_whose_request_never_comes_is_dropped_at_the_handoff_deadline(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # The push completes without a start (so nothing runs on it), and no Decode ever comes: the decode worker
    # frees its blocks at the deadline, as the prefill worker frees its lease.
    cluster = await start_inprocess_cluster(
        llama_checkpoint, ClusterOptions(num_kv_blocks=256, gateway=False, kv_handoff_timeout_s=0.5)
    )
    pusher = cluster.prefill.servicer.pusher
    finish = pusher.finish

    async def finish_without_start(request_id: str, timeout_s: float, start: object = None) -> bool:
        return await finish(request_id, timeout_s, None)

    pusher.finish = finish_without_start
    await _prefill_pushed(cluster, "never-decoded", random_prompts([70], seed=143)[0])
    pushes = _pushes(cluster.decode)
    await wait_until(lambda: len(pushes) == 0, "the unclaimed push dropped at the deadline")
    assert (pushes.num_expired, pushes.num_bytes, cluster.decode.servicer.early.num_started) == (1, 0, 0)
    await wait_until(lambda: cluster.prefill.runtime.engine.leases.num_expired == 1, "the lease expired")
    await _assert_nothing_held(cluster)


class _RecordingStub:
    """A worker stub of the gateway's that records which RPCs the gateway calls on it."""

    def __init__(self, stub: object, called: list[str]) -> None:
        self._stub, self._called = stub, called

    def __getattr__(self, name: str) -> object:
        self._called.append(name)
        return getattr(self._stub, name)


@pytest.mark.asyncio
async def test_the_gateway_routes_and_relays_and_never_manages_kv(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # A request that runs to its end, one the first token ends, and one cancelled mid-push: the workers
    # release leases and drop pushes among themselves; the gateway prefills, decodes, polls loads and at
    # most relays a client's end to a decode worker (Abort), never ReleaseKV or DropPush.
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256))
    assert cluster.gateway is not None and cluster.stub is not None
    called: list[str] = []
    for handle in cluster.gateway.pool.workers.values():
        handle.stub = _RecordingStub(handle.stub, called)  # type: ignore[assignment]
    oracle = Oracle(llama_checkpoint)
    prompt = random_prompts([70], seed=144)[0]
    assert _tokens(await cluster.generate(_request(prompt))) == oracle.generate(prompt, MAX_TOKENS)
    first_token = oracle.generate(prompt, 1)[0]
    ends_at_once = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[first_token])
    responses = await cluster.generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt,
                                                                     sampling_params=ends_at_once))
    assert _tokens(responses) == [first_token]
    engine = cluster.prefill.runtime.engine
    hold = _HoldPrefillAtLayer(engine.kv_pusher.sink, layer=1)
    engine.kv_pusher.sink = hold
    call = cluster.stub.Generate(_request(random_prompts([200], seed=145)[0]), timeout=30)
    try:
        assert await asyncio.to_thread(hold.reached.wait, 30)
        await _wait_for_push_started(cluster)
        call.cancel()
    finally:
        hold.release.set()
    assert await call.code() == grpc.StatusCode.CANCELLED
    await _assert_nothing_held(cluster)
    assert {"Prefill", "Decode"} <= set(called) <= {"Prefill", "Decode", "Load", "Abort"}


class _DecodeThatNeverArrives:
    """The gateway's stub of a decode worker whose Decode calls never reach it (as a call cancelled before it
    is sent), while every other RPC does."""

    def __init__(self, stub: object) -> None:
        self._stub = stub
        self.calls = 0

    def Decode(self, request: worker_pb2.DecodeRequest, timeout: float | None = None) -> object:  # noqa: N802
        self.calls += 1
        return _SilentCall()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)


class _SilentCall:
    """A streaming call that sends nothing until it is cancelled."""

    def __init__(self) -> None:
        self._cancelled = asyncio.Event()

    def cancel(self) -> bool:
        self._cancelled.set()
        return True

    def __aiter__(self) -> _SilentCall:
        return self

    async def __anext__(self) -> worker_pb2.DecodeResponse:
        await self._cancelled.wait()
        raise StopAsyncIteration


@pytest.mark.asyncio
async def test_a_client_that_ends_before_its_decode_reaches_the_worker_has_the_gateway_relay_it(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # The push completed and started the request on the decode worker; the client cancels after its first token,
    # and the Decode never got there: the gateway's Abort tells the decode worker, which ends the early start,
    # and releases the prefill worker's lease, at once rather than at the handoff deadline (30 s here).
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(num_kv_blocks=256))
    assert cluster.gateway is not None and cluster.stub is not None
    (handle,) = [w for w in cluster.gateway.pool.workers.values() if w.role == "decode"]
    silent = _DecodeThatNeverArrives(handle.stub)
    handle.stub = silent  # type: ignore[assignment]
    call = cluster.stub.Generate(_request(random_prompts([70], seed=146)[0]), timeout=30)
    first = await call.read()
    assert len(first.token_ids) == 1
    early = cluster.decode.servicer.early
    await wait_until(lambda: early.num_started == 1, "the push to start the request")
    call.cancel()
    assert await call.code() == grpc.StatusCode.CANCELLED
    await wait_until(lambda: early.num_ended == 1, "the early start ended by the relayed Abort")
    assert (silent.calls, early.num_claimed, early.num_expired) == (1, 0, 0)
    assert cluster.prefill.runtime.engine.leases.num_expired == 0
    await _assert_nothing_held(cluster)


@pytest.mark.asyncio
async def test_abort_needs_the_handoff_it_ends(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await start_inprocess_cluster(llama_checkpoint, ClusterOptions(gateway=False))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _decode_stub(cluster).Abort(worker_pb2.AbortRequest(request_id="r"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "handoff must be set: it names the prefill worker whose lease ends"
