"""The gateway's side of conditional disaggregation: route a request's prefill, run a local one, learn from both.

``choose_route`` gathers what the policy (pdserve/gateway/disaggregation.py) weighs —
the best prefill worker and its queue, the decode worker, what each caches of
the prompt — and asks it; ``stream_local_prefill`` relays a prefill done on
the decode worker; ``learn`` feeds a finished request's timings back to the
cost model.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pdserve.gateway.decode_stream import DecodeStream
from pdserve.gateway.disaggregation import DisaggregationPolicy, MeasuredCosts, RouteDecision, RouteInputs
from pdserve.gateway.migration import migrate
from pdserve.gateway.router import NoWorkerAvailable, PrefillChoice, Router
from pdserve.gateway.workers import WorkerHandle
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.errors import Unavailable
from pdserve.service_common.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class RequestTiming:
    """When a request's tokens arrived, counted from when it was routed: what the cost model learns from."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.started = clock()
        self.num_tokens = 0
        self.first_token_s: float | None = None
        self.second_token_gap_s: float | None = None
        self._second_at = self._last_at = 0.0
        self._tokens_at_second = 0

    def responded(self, response: generation_pb2.GenerateResponse) -> None:
        if not response.token_ids:
            return
        now = self._clock()
        if self.first_token_s is None:
            self.first_token_s = now - self.started
        elif self.second_token_gap_s is None:
            self.second_token_gap_s = now - self.started - self.first_token_s
            self._second_at, self._tokens_at_second = now, self.num_tokens + 1
        self.num_tokens += len(response.token_ids)
        self._last_at = now

    @property
    def time_per_output_token_s(self) -> float | None:
        """From the second token on (a handoff, if any, came before it)."""
        steps = self.num_tokens - self._tokens_at_second
        if self.second_token_gap_s is None or steps < 1:
            return None
        return (self._last_at - self._second_at) / steps


@dataclass
class Route:
    """One request's routing: the decision, what it was made from, and the request's timing."""

    decision: RouteDecision
    inputs: RouteInputs | None = None  # auto routing only
    prefill: PrefillChoice | None = None  # the prefill worker auto routing weighed (remote prefill starts there)
    decode: WorkerHandle | None = None  # the decode worker of a local prefill
    timing: RequestTiming = field(default_factory=RequestTiming)


async def choose_route(
    policy: DisaggregationPolicy, router: Router, metrics: GatewayMetrics,
    request: generation_pb2.GenerateRequest, token_ids: list[int], lora_name: str | None = None,
) -> Route:
    """Where the prompt is prefilled: a prefill worker (remote) or the decode worker (local); counted in metrics."""
    prompt_logprobs = request.sampling_params.HasField("prompt_logprobs")
    has_prefill_worker = bool(router.pool.healthy("prefill"))
    if policy.mode != "auto" or prompt_logprobs or not has_prefill_worker:
        decision = policy.decide(None, has_prefill_worker=has_prefill_worker, prompt_logprobs=prompt_logprobs)
        route = Route(decision, decode=_choose_decode(router, lora_name) if decision.local else None)
    else:
        try:
            choice = await router.choose_prefill(token_ids, lora_name=lora_name)
        except NoWorkerAvailable as error:
            raise Unavailable(str(error)) from error
        decode = _choose_decode(router, lora_name)
        local_cached = await router.decode_cached_tokens(decode, token_ids, choice.block_hashes, lora_name)
        report = decode.report
        inputs = RouteInputs(
            prompt_tokens=len(token_ids),
            remote_cached_tokens=choice.expected_cached_tokens,
            local_cached_tokens=local_cached,
            prefill_queued_tokens=choice.queued_tokens,
            decode_queued_tokens=max(decode.inflight_tokens, report.num_queued_tokens if report else 0),
            decode_running=max(decode.inflight_requests, report.num_running if report else 0),
        )
        route = Route(policy.route(decode.address, inputs), inputs, choice, decode)
    metrics.prefill_routed(route.decision.route, route.decision.reason)
    log.debug("prefill %s (%s): %s", route.decision.route, route.decision.reason, route.decision)
    return route


def _choose_decode(router: Router, lora_name: str | None = None) -> WorkerHandle:
    try:
        return router.choose_decode(lora_name)
    except NoWorkerAvailable as error:
        raise Unavailable(str(error)) from error


async def stream_local_prefill(stream: DecodeStream, route: Route) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """Local prefill: the decode worker computes the prompt and streams every token, ending with usage. When
    it fails, the stream moves to another decode worker (``migrate``): after the tokens the client has, or from
    the prompt when it has none yet."""
    decode = route.decode
    assert decode is not None, "a local route names its decode worker"
    router = stream.router
    decode_request = worker_pb2.DecodeRequest(request_id=stream.request_id, prompt_token_ids=stream.token_ids,
                                              sampling_params=stream.request.sampling_params, lora=stream.lora)

    def prefilled(piece: worker_pb2.DecodeResponse) -> None:
        stream.usage.cached_prompt_tokens = piece.cached_prompt_tokens
        if route.prefill is not None:
            router.prefilled_locally(decode, route.prefill.block_hashes)

    # Its uncomputed prompt tokens count as queued work there until the first token.
    uncached = len(stream.token_ids) - (route.inputs.local_cached_tokens if route.inputs is not None else 0)
    relayed = stream.relay(decode, decode_request, queued_tokens=uncached, on_first_piece=prefilled)
    async with contextlib.aclosing(relayed):
        async for response in relayed:
            yield response
    if stream.failure is not None:
        rest = migrate(stream)
        async with contextlib.aclosing(rest):
            async for response in rest:
                yield response


def learn(policy: DisaggregationPolicy, route: Route) -> None:
    """Feed a finished request's timings to a cost model that learns (auto routing only)."""
    costs, timing = policy.costs, route.timing
    if route.inputs is None or timing.first_token_s is None or not isinstance(costs, MeasuredCosts):
        return
    costs.observe_request(route.decision, route.inputs, timing.first_token_s, timing.second_token_gap_s,
                          timing.time_per_output_token_s, timing.num_tokens)
