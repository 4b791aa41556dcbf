"""Soak: a fresh local cluster under a long mixed load with injected faults; reports what was lost or leaked.

    python -m benchmarks.soak --minutes 5 [--clients 8] [--cancel-fraction 0.3] [--deadline-fraction 0.1]
                              [--seed 0] [--model PATH] [--max-requests N] [--json out.json]

Clients each send one request at a time, drawn from one seeded stream: random
prompt length and ``max_tokens`` (greedy, EOS ignored, so a finished request has
exactly ``max_tokens`` tokens), and a fault: none, a cancel (``call.cancel()``
after a random number of tokens, or at a random moment before the first), or a
short deadline. The run is bounded in time (``--minutes``) and count
(``--max-requests``). Then it reports:

- outcomes: status codes per fault;
- requests lost: a status other than the fault allows (none: OK; cancel: OK or
  CANCELLED; deadline: OK or DEADLINE_EXCEEDED), an OK stream with the wrong
  number of tokens, or a request that never ended (still running ``--hang-s``
  after its deadline);
- blocks leaked: KV blocks not free on each worker once the cluster is idle
  (polled up to ``--idle-wait-s``, shorter than the 30 s prefill lease, so a
  lease nobody released shows up as a leak);
- resident memory (VmRSS) of every process at start (after a warm-up), middle and end.

The test ``tests/e2e/test_soak.py`` is the short CI form and drives the load with
the same functions.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from benchmarks.workload import LOWEST_ORDINARY_TOKEN_ID
from pdserve.launcher import ClusterConfig, LocalCluster
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.server import channel_options

FAULTS = ("none", "cancel", "deadline")
# The statuses each fault may end with; anything else is a lost request.
ALLOWED_CODES: dict[str, frozenset[grpc.StatusCode]] = {
    "none": frozenset({grpc.StatusCode.OK}),
    "cancel": frozenset({grpc.StatusCode.OK, grpc.StatusCode.CANCELLED}),
    "deadline": frozenset({grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}),
}


@dataclass(frozen=True)
class LoadShape:
    """The distribution requests are drawn from."""

    vocab_size: int
    min_prompt_len: int = 1
    max_prompt_len: int = 200
    min_max_tokens: int = 1
    max_max_tokens: int = 32
    cancel_fraction: float = 0.3
    deadline_fraction: float = 0.1
    deadline_s: tuple[float, float] = (0.02, 0.5)  # short deadlines, uniform in this range
    cancel_delay_s: tuple[float, float] = (0.0, 0.1)  # cancels before the first token: wait this long
    request_timeout_s: float = 60.0  # every other request: generous, so only a hang reaches it
    lowest_token_id: int = LOWEST_ORDINARY_TOKEN_ID

    def __post_init__(self) -> None:
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError(f"need 1 <= min_prompt_len <= max_prompt_len, got {self.min_prompt_len}, {self.max_prompt_len}")
        if not 1 <= self.min_max_tokens <= self.max_max_tokens:
            raise ValueError(f"need 1 <= min_max_tokens <= max_max_tokens, got {self.min_max_tokens}, {self.max_max_tokens}")
        if not (0 <= self.cancel_fraction and 0 <= self.deadline_fraction and self.cancel_fraction + self.deadline_fraction <= 1):
            raise ValueError("cancel and deadline fractions must be >= 0 and sum to at most 1")


@dataclass(frozen=True)
class SoakRequest:
    """One request and the fault injected into it."""

    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    fault: str  # one of FAULTS
    cancel_after_tokens: int  # cancel: once this many tokens arrived; 0: before the first, after cancel_delay_s
    cancel_delay_s: float
    timeout_s: float


@dataclass(frozen=True)
class Outcome:
    """How one request ended."""

    request: SoakRequest
    code: grpc.StatusCode
    num_tokens: int  # tokens received
    completion_tokens: int | None  # the usage the server reported on the last response, if it came

    @property
    def lost(self) -> bool:
        if self.code not in ALLOWED_CODES[self.request.fault]:
            return True
        # A stream that ended OK must be whole (only a cancel may stop reading early).
        if self.code == grpc.StatusCode.OK and self.request.fault != "cancel":
            return (self.num_tokens, self.completion_tokens) != (self.request.max_tokens, self.request.max_tokens)
        return False


@dataclass
class Tally:
    """Every outcome of a run, and the requests that never ended."""

    outcomes: list[Outcome] = field(default_factory=list)
    never_ended: list[SoakRequest] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.outcomes) + len(self.never_ended)

    @property
    def lost(self) -> list[Outcome | SoakRequest]:
        return [o for o in self.outcomes if o.lost] + list(self.never_ended)

    def codes(self, fault: str | None = None) -> Counter[str]:
        """Status names of the requests with ``fault`` (all when None)."""
        return Counter(o.code.name for o in self.outcomes if fault is None or o.request.fault == fault)

    def faults(self) -> Counter[str]:
        """Faults injected: planned per request, whatever the request then did."""
        return Counter(o.request.fault for o in self.outcomes) + Counter(r.fault for r in self.never_ended)

    def summary(self) -> dict[str, object]:
        return {
            "requests": self.num_requests,
            "outcomes": dict(self.codes()),
            "outcomes_by_fault": {fault: dict(self.codes(fault)) for fault in FAULTS},
            "faults_injected": dict(self.faults()),
            "requests_lost": len(self.lost),
            "lost": [_describe(item) for item in self.lost[:20]],
        }


def _describe(item: Outcome | SoakRequest) -> str:
    if isinstance(item, SoakRequest):
        return f"#{item.index} ({item.fault}, {len(item.prompt_token_ids)}-token prompt, max_tokens {item.max_tokens}) never ended"
    request = item.request
    return (f"#{request.index} ({request.fault}, {len(request.prompt_token_ids)}-token prompt, max_tokens "
            f"{request.max_tokens}) ended {item.code.name} with {item.num_tokens} tokens (usage {item.completion_tokens})")


def make_request(rng: random.Random, shape: LoadShape, index: int) -> SoakRequest:
    """One request of ``shape``, every choice drawn from ``rng``."""
    length = rng.randint(shape.min_prompt_len, shape.max_prompt_len)
    prompt = tuple(rng.randrange(shape.lowest_token_id, shape.vocab_size) for _ in range(length))
    max_tokens = rng.randint(shape.min_max_tokens, shape.max_max_tokens)
    draw = rng.random()
    fault = "cancel" if draw < shape.cancel_fraction else "deadline" if draw < shape.cancel_fraction + shape.deadline_fraction else "none"
    cancel_after = rng.randrange(max_tokens) if fault == "cancel" else 0
    cancel_delay = rng.uniform(*shape.cancel_delay_s) if fault == "cancel" else 0.0
    timeout = rng.uniform(*shape.deadline_s) if fault == "deadline" else shape.request_timeout_s
    return SoakRequest(index, prompt, max_tokens, fault, cancel_after, cancel_delay, timeout)


def request_stream(shape: LoadShape, seed: int) -> Iterator[SoakRequest]:
    """Endless seeded requests of ``shape``."""
    rng = random.Random(seed)
    for index in itertools.count():
        yield make_request(rng, shape, index)


async def run_one(stub: generation_pb2_grpc.GenerationStub, request: SoakRequest) -> Outcome:
    """Send ``request``, inject its fault, and read the stream to its end."""
    params = generation_pb2.SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
    call = stub.Generate(
        generation_pb2.GenerateRequest(prompt_token_ids=request.prompt_token_ids, sampling_params=params),
        timeout=request.timeout_s,
    )
    num_tokens, completion_tokens = 0, None
    try:
        if request.fault == "cancel" and request.cancel_after_tokens == 0:
            # Somewhere in queueing, prefill or the KV handoff, before the first token arrives.
            await asyncio.sleep(request.cancel_delay_s)
            call.cancel()
        else:
            # read() throughout: grpc.aio forbids mixing it with iteration on one call.
            while (response := await call.read()) is not grpc.aio.EOF:
                num_tokens += len(response.token_ids)
                if response.HasField("usage"):
                    completion_tokens = response.usage.completion_tokens
                if request.fault == "cancel" and num_tokens >= request.cancel_after_tokens:
                    call.cancel()
                    break
        code = await call.code()
    except grpc.aio.AioRpcError as error:
        code = error.code()
    return Outcome(request, code, num_tokens, completion_tokens)


async def drive(
    endpoint: str,
    requests: Iterator[SoakRequest],
    clients: int,
    *,
    until: float | None = None,
    max_requests: int | None = None,
    hang_s: float = 30.0,
) -> Tally:
    """``clients`` concurrent clients, each sending one request at a time from ``requests``.

    Stops taking requests once ``requests`` runs out, ``max_requests`` were sent,
    or the event loop's clock passes ``until``. A request still running
    ``hang_s`` after its own deadline never ended: it is cancelled and counted.
    """
    tally = Tally()
    loop = asyncio.get_running_loop()
    taken = itertools.count()
    source = iter(requests)

    def next_request() -> SoakRequest | None:
        if until is not None and loop.time() >= until:
            return None
        if max_requests is not None and next(taken) >= max_requests:
            return None
        return next(source, None)

    async def client(stub: generation_pb2_grpc.GenerationStub) -> None:
        while (request := next_request()) is not None:
            try:
                outcome = await asyncio.wait_for(run_one(stub, request), request.timeout_s + hang_s)
            except TimeoutError:
                tally.never_ended.append(request)
            else:
                tally.outcomes.append(outcome)

    async with grpc.aio.insecure_channel(endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await asyncio.gather(*(client(stub) for _ in range(clients)))
    return tally


async def load_report(address: str, role: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub_class = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        return await stub_class(channel).Load(worker_pb2.LoadRequest(), timeout=5)


def worker_roles(cluster: LocalCluster) -> dict[str, str]:
    """Worker name -> the role its Load is asked as (a colocated worker answers either)."""
    return {name: "decode" if role == "decode" else "prefill" for role, name in cluster.worker_names()}


async def wait_idle(cluster: LocalCluster, timeout_s: float) -> dict[str, worker_pb2.LoadReport]:
    """Every worker's load report once none runs, queues or holds a block (or the last ones after ``timeout_s``).

    Releases after cancels and deadlines happen in the background, hence the wait.
    """
    roles = worker_roles(cluster)
    deadline = time.monotonic() + timeout_s
    while True:
        reports = {name: await load_report(cluster.addresses[name], role) for name, role in roles.items()}
        idle = all(r.num_running == r.num_waiting == 0 and r.num_free_blocks == r.num_total_blocks for r in reports.values())
        if idle or time.monotonic() > deadline:
            return reports
        await asyncio.sleep(0.05)


def leaked_blocks(reports: dict[str, worker_pb2.LoadReport]) -> dict[str, int]:
    return {name: r.num_total_blocks - r.num_free_blocks for name, r in reports.items()}


def rss_kib(pid: int) -> int:
    """Resident memory of a process in KiB (VmRSS from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS line for pid {pid}")


def cluster_rss_kib(cluster: LocalCluster) -> dict[str, int]:
    """VmRSS of the workers and the gateway (not Redis)."""
    return {name: rss_kib(cluster.process(name).pid) for name in [*worker_roles(cluster), "gateway"]}


async def soak(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, object]:
    first_prefill = next(name for name, role in worker_roles(cluster).items() if role == "prefill")
    model = await load_report(cluster.addresses[first_prefill], "prefill")
    shape = LoadShape(
        vocab_size=model.vocab_size,
        max_prompt_len=min(args.max_prompt_len, model.max_model_len - args.max_output_len),
        max_max_tokens=args.max_output_len,
        cancel_fraction=args.cancel_fraction,
        deadline_fraction=args.deadline_fraction,
    )
    # Warm-up: every client once, no faults, so "start" memory is after first allocations.
    warm = LoadShape(shape.vocab_size, max_prompt_len=shape.max_prompt_len, max_max_tokens=shape.max_max_tokens,
                     cancel_fraction=0.0, deadline_fraction=0.0)
    warmup = await drive(cluster.endpoint, request_stream(warm, args.seed + 1), args.clients, max_requests=args.clients)
    await wait_idle(cluster, args.idle_wait_s)
    rss = {"start": cluster_rss_kib(cluster)}

    loop = asyncio.get_running_loop()
    started = loop.time()
    duration = args.minutes * 60

    async def sample_middle() -> None:
        await asyncio.sleep(duration / 2)
        rss["middle"] = cluster_rss_kib(cluster)

    sampler = asyncio.create_task(sample_middle())
    tally = await drive(cluster.endpoint, request_stream(shape, args.seed), args.clients,
                        until=started + duration, max_requests=args.max_requests, hang_s=args.hang_s)
    wall_s = loop.time() - started
    if not sampler.done():  # stopped by --max-requests before half time: the middle is now
        sampler.cancel()
        rss["middle"] = cluster_rss_kib(cluster)
    reports = await wait_idle(cluster, args.idle_wait_s)
    rss["end"] = cluster_rss_kib(cluster)
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "model_id": model.model_id,
        "wall_s": wall_s,
        "warmup_lost": len(warmup.lost),
        **tally.summary(),
        "tokens_received": sum(o.num_tokens for o in tally.outcomes),
        "blocks_leaked": leaked_blocks(reports),
        "idle_after_run": {name: {"num_running": r.num_running, "num_waiting": r.num_waiting,
                                  "num_free_blocks": r.num_free_blocks, "num_total_blocks": r.num_total_blocks}
                           for name, r in reports.items()},
        "rss_kib": rss,
        "shape": asdict(shape),
    }


def _print(result: dict[str, object]) -> None:
    print(f"soak: {result['requests']} requests in {result['wall_s']:.1f} s "
          f"({result['tokens_received']} tokens received), model {result['model_id']}")
    print(f"outcomes: {result['outcomes']}")
    for fault, codes in result["outcomes_by_fault"].items():  # type: ignore[union-attr]
        print(f"  {fault:>8}: {codes}")
    print(f"faults injected: {result['faults_injected']}")
    print(f"requests lost: {result['requests_lost']} (warm-up: {result['warmup_lost']})")
    for line in result["lost"]:  # type: ignore[union-attr]
        print(f"  {line}")
    print(f"blocks leaked: {result['blocks_leaked']}")
    rss = result["rss_kib"]
    print("resident memory (MiB):        start   middle      end")
    for name in rss["start"]:  # type: ignore[index]
        values = [rss[point][name] / 1024 for point in ("start", "middle", "end")]  # type: ignore[index]
        print(f"  {name:<24} {values[0]:8.1f} {values[1]:8.1f} {values[2]:8.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to keep sending (default 5)")
    parser.add_argument("--max-requests", type=int, default=None, help="stop after this many requests (default: no limit)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients, one request each at a time")
    parser.add_argument("--cancel-fraction", type=float, default=0.3)
    parser.add_argument("--deadline-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="local checkpoint folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--kv-transport", default="grpc", choices=["grpc", "shm", "torch_dist"])
    parser.add_argument("--num-kv-blocks", type=int, default=512, help="KV pool of every worker")
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=32)
    parser.add_argument("--hang-s", type=float, default=60.0, help="past its deadline by this much, a request never ended")
    parser.add_argument("--idle-wait-s", type=float, default=10.0, help="how long the cluster may take to free everything")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()

    config = ClusterConfig(
        model=args.model, dtype=args.dtype, port=0, prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers, kv_transport=args.kv_transport,
        engine_args=("--num-kv-blocks", str(args.num_kv_blocks)), redis_prefix=f"pdserve-soak-{time.time_ns()}",
        disaggregation="always",  # the faults injected here hit the handoff path
    )
    with LocalCluster(config) as cluster:
        result = asyncio.run(soak(cluster, args))
    _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    clean = result["requests_lost"] == 0 and result["warmup_lost"] == 0 and not any(result["blocks_leaked"].values())  # type: ignore[union-attr]
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
