"""Drives a backend with a workload: arrivals, the concurrency limit, and one record per request."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.backend import Backend, BackendError, BackendRequest, Usage
from pdserve.bench.record import RequestError, RequestRecord
from pdserve.bench.request import BenchRequest

NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0, cached_prompt_tokens=0)


@dataclass(frozen=True)
class SamplingConfig:
    """How every request of a run samples and how long it may take."""

    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0


@dataclass(frozen=True)
class RunConfig:
    """How one run sends its requests."""

    request_rate: float = math.inf  # requests per second; inf sends all at once
    burstiness: float = 1.0
    max_concurrency: int | None = None  # None: no limit
    seed: int = 0  # arrival gaps, and request i samples with seed + i
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    request_id_prefix: str = "bench"
    show_progress: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class RunOutcome:
    """The records of one run and how long it lasted (first send to last stream closed)."""

    request_rate: float
    duration_s: float
    records: tuple[RequestRecord, ...]


async def run_requests(
    backend: Backend,
    requests: tuple[BenchRequest, ...],
    config: RunConfig,
    clock: Callable[[], float] = time.perf_counter,
) -> RunOutcome:
    """Send ``requests`` at ``config``'s arrival times; every timestamp is on ``clock`` (the backend's clock too)."""
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
    limit: asyncio.Semaphore | contextlib.nullcontext[None] = (
        asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
    )
    progress = tqdm(total=len(requests), desc=config.description or None, unit="req", file=sys.stderr,
                    disable=not config.show_progress, dynamic_ncols=True)
    origin = clock()

    async def send(index: int, request: BenchRequest, offset: float) -> RequestRecord:
        # Sleep to an absolute time rather than gap after gap, so sleep overshoot does not accumulate.
        delay = origin + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        # As in vLLM, a request's clock starts once it holds a slot: TTFT excludes the client-side queue.
        async with limit:
            record = await measure_request(backend, index, request, config, clock, origin)
        progress.update(1)
        return record

    try:
        records = await asyncio.gather(*(send(i, r, o) for i, (r, o) in enumerate(zip(requests, offsets))))
    finally:
        progress.close()
    return RunOutcome(request_rate=config.request_rate, duration_s=clock() - origin, records=tuple(records))


async def measure_request(
    backend: Backend,
    index: int,
    request: BenchRequest,
    config: RunConfig,
    clock: Callable[[], float],
    origin: float,
) -> RequestRecord:
    """Stream one request to its end and record it; a failure becomes the record's error, never an exception."""
    sampling = config.sampling
    backend_request = BackendRequest(
        request_id=f"{config.request_id_prefix}-{index}",
        prompt_token_ids=request.prompt_token_ids,
        prompt=request.prompt,
        max_tokens=request.output_len,
        temperature=sampling.temperature,
        ignore_eos=sampling.ignore_eos,
        seed=config.seed + index,
        timeout_s=sampling.timeout_s,
    )
    times: list[float] = []
    tokens: list[int] = []
    usage: Usage | None = None
    error: RequestError | None = None
    start = clock()
    try:
        async for chunk in backend.stream(backend_request):
            if chunk.num_tokens > 0:
                times.append(chunk.timestamp - origin)
                tokens.append(chunk.num_tokens)
            if chunk.usage is not None:
                usage = chunk.usage
    except BackendError as failure:
        error = RequestError(failure.code, failure.message)
    except Exception as failure:  # noqa: BLE001 - one broken request must not end the run; it is recorded
        error = RequestError("CLIENT", f"{type(failure).__name__}: {failure}")
    end = clock()
    if error is None and usage is None:
        error = RequestError("INCOMPLETE", "the stream ended without usage")
    elif error is None and not times:
        error = RequestError("INCOMPLETE", "the stream ended without a token")
    counts = usage if error is None and usage is not None else NO_USAGE
    return RequestRecord(
        index=index,
        start=start - origin,
        end=end - origin,
        chunk_times=tuple(times),
        chunk_tokens=tuple(tokens),
        prompt_tokens=counts.prompt_tokens,
        output_tokens=counts.completion_tokens,
        cached_prompt_tokens=counts.cached_prompt_tokens,
        error=error,
        spec_decode_drafts=counts.spec_decode_drafts,
        spec_decode_draft_tokens=counts.spec_decode_draft_tokens,
        spec_decode_accepted_tokens=counts.spec_decode_accepted_tokens,
    )
