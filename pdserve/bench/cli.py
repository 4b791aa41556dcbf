"""``pdserve bench``: its arguments, and the benchmark from connecting to writing results."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, TypeVar

from pdserve.bench.backend import Backend, BackendError
from pdserve.bench.config import (
    BACKENDS,
    BenchConfig,
    parse_mix,
    parse_rate,
    parse_rates,
    parse_slos,
    rate_label,
)
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.report import (
    RunResult,
    format_run_table,
    format_sweep_table,
    result_document,
    write_result_json,
)
from pdserve.bench.runner import SamplingConfig, run_requests
from pdserve.bench.workload import (
    PREFIX_ORDERS,
    WORKLOAD_KINDS,
    BenchRequest,
    WorkloadConfig,
    build_workload,
    warmup_requests,
)
from pdserve.security_flags import (
    add_auth_token_argument,
    add_client_tls_arguments,
    auth_token_from_args,
    client_tls_from_args,
)

T = TypeVar("T")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench`` (those of ``vllm bench serve`` where they mean the same)."""
    server = parser.add_argument_group("server")
    server.add_argument("--backend", default="grpc", choices=BACKENDS,
                        help="protocol of the server: grpc (pdserve.v1.Generation) or http (the OpenAI API's "
                        "streamed /v1/completions, e.g. the gateway's --http-port) (default grpc)")
    server.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT",
                        help="the gateway to drive (its gRPC port, or its HTTP port with --backend http)")
    server.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="deadline of each request")
    add_client_tls_arguments(server, "the gateway")
    add_auth_token_argument(server, "send")

    workload = parser.add_argument_group("workload (every draw seeded by --seed)")
    workload.add_argument("--workload", default="random", choices=WORKLOAD_KINDS,
                          help="random token ids, shared prefixes plus random suffixes, or a JSONL file")
    workload.add_argument("--num-prompts", type=int, default=100, help="requests per run (default 100)")
    workload.add_argument("--input-len", type=int, default=128,
                          help="mean prompt tokens (prefix workload: suffix tokens after the prefix)")
    workload.add_argument("--output-len", type=int, default=64,
                          help="mean max_tokens (file workload: for lines without output_len)")
    workload.add_argument("--range-ratio", type=float, default=0.0, metavar="R",
                          help="lengths uniform in [mean*(1-R), mean*(1+R)] (default 0: exact)")
    workload.add_argument("--num-prefixes", type=int, default=4, metavar="K", help="prefix workload: shared prefixes")
    workload.add_argument("--prefix-len", type=int, default=128, metavar="P", help="prefix workload: tokens per prefix")
    workload.add_argument("--prefix-order", default="round-robin", choices=PREFIX_ORDERS,
                          help="prefix workload: how requests pick their prefix")
    workload.add_argument("--dataset", type=Path, default=None, metavar="PATH.jsonl",
                          help='file workload: lines {"prompt": "..."} or {"prompt_token_ids": [...]}, '
                          'optionally with "output_len": N')
    workload.add_argument("--long-len", type=int, default=1024, metavar="L",
                          help="mixed workload: mean tokens of a long document (default 1024)")
    workload.add_argument("--mix", type=_argparse(parse_mix), default=(0.6, 0.2, 0.2), metavar="CHAT,LONG,PREFIX",
                          help="mixed workload: weights of chat turns (--input-len), long documents (--long-len) and "
                          "questions on shared prefixes (--num-prefixes of --prefix-len, then --input-len); "
                          "default 0.6,0.2,0.2")
    workload.add_argument("--seed", type=int, default=0)

    sending = parser.add_argument_group("sending")
    sending.add_argument("--request-rate", type=_argparse(parse_rate), default=math.inf, metavar="R",
                         help="requests per second, gamma-distributed gaps (default inf: all at once)")
    sending.add_argument("--burstiness", type=float, default=1.0,
                         help="shape of the gamma gaps: 1 is Poisson, below 1 burstier, above 1 more even")
    sending.add_argument("--sweep", type=_argparse(parse_rates), default=None, metavar="R1,R2,...",
                         help="one run per rate, in order, on the same workload (overrides --request-rate); "
                         "later runs find earlier runs' prompts in the server's prefix cache")
    sending.add_argument("--max-concurrency", type=int, default=None, metavar="C",
                         help="at most C requests in flight; a request's clock starts when it gets a slot")
    sending.add_argument("--warmup", type=int, default=0, metavar="N",
                         help="N requests of fresh random ids first, not measured")
    sending.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    sending.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens per request")

    results = parser.add_argument_group("results")
    results.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                         help="SLOs for goodput, any of ttft:MS tpot:MS e2el:MS")
    results.add_argument("--result-json", type=Path, default=None, metavar="PATH",
                         help="write the configuration, every metric and every request's record")
    results.add_argument("--plot-dir", type=Path, default=None, metavar="DIR",
                         help="write latency CDFs per run (and throughput against rate for --sweep) as PNG")
    results.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    workload = WorkloadConfig(
        kind=args.workload,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        prefix_order=args.prefix_order,
        dataset=args.dataset,
        seed=args.seed,
        long_len=args.long_len,
        mix=args.mix,
    )
    return BenchConfig(
        workload=workload,
        backend=args.backend,
        target=args.target,
        tls=client_tls_from_args(args),
        request_rates=args.sweep or (args.request_rate,),
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        warmup=args.warmup,
        slos=parse_slos(args.goodput),
        sampling=SamplingConfig(
            temperature=args.temperature, ignore_eos=args.ignore_eos, timeout_s=args.request_timeout
        ),
        result_json=args.result_json,
        plot_dir=args.plot_dir,
        show_progress=not args.disable_tqdm,
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run ``pdserve bench``; 0 once any request completed, 1 otherwise. Bad options raise ValueError."""
    return asyncio.run(bench(config_from_args(args), auth_token=auth_token_from_args(args)))


async def bench(config: BenchConfig, out: TextIO | None = None, auth_token: str | None = None) -> int:
    """Every run of ``config``, its tables on ``out`` (default stdout), then the JSON and plots it asks for.

    ``auth_token`` stays out of ``config``: the config is written to the result JSON.
    """
    out = out or sys.stdout  # looked up per call, so a replaced sys.stdout (tests, redirection) is honoured
    backend = make_backend(config, auth_token)
    try:
        try:
            model = await backend.model_info()
        except BackendError as error:
            print(f"pdserve bench: cannot describe the model served at {config.target}: {error}", file=sys.stderr)
            return 1
        requests = build_workload(config.workload, model.vocab_size)
        _warn_about_context(requests, model.max_context_length)
        # A fresh id per invocation keeps request ids unique among other clients' requests in flight.
        invocation = f"bench-{uuid.uuid4().hex[:8]}"
        if config.warmup:
            await _warm_up(backend, config, requests, model.vocab_size, invocation)
        results = []
        for number, rate in enumerate(config.request_rates):
            run_config = config.run_config(rate, f"{invocation}-{number}", description=f"{rate_label(rate)} req/s")
            outcome = await run_requests(backend, requests, run_config)
            metrics = compute_metrics(outcome.records, outcome.duration_s, config.slos)
            result = RunResult(outcome=outcome, metrics=metrics)
            print(format_run_table(result), file=out, flush=True)
            results.append(result)
    finally:
        await backend.close()
    if len(results) > 1:
        print(format_sweep_table(results), file=out)
    if config.result_json is not None:
        write_result_json(config.result_json, result_document(config, model, results))
        print(f"results: {config.result_json}", file=out)
    if config.plot_dir is not None:
        from pdserve.bench.plots import write_plots  # imports matplotlib: only when plots are asked for

        for path in write_plots(results, config.plot_dir):
            print(f"plot: {path}", file=out)
    return 0 if any(result.metrics.completed for result in results) else 1


def make_backend(config: BenchConfig, auth_token: str | None = None) -> Backend:
    if config.backend == "http":
        from pdserve.bench.http_backend import HttpBackend

        return HttpBackend(config.target, tls=config.tls, auth_token=auth_token)
    from pdserve.bench.grpc_backend import GrpcBackend

    return GrpcBackend(config.target, tls=config.tls, auth_token=auth_token)


async def _warm_up(
    backend: Backend, config: BenchConfig, requests: tuple[BenchRequest, ...], vocab_size: int, invocation: str
) -> None:
    warmups = warmup_requests(requests, config.warmup, vocab_size, config.workload.seed)
    run_config = dataclasses.replace(config.run_config(math.inf, f"{invocation}-warmup"), show_progress=False)
    outcome = await run_requests(backend, warmups, run_config)
    failures = [record.error for record in outcome.records if record.error is not None]
    if failures:
        print(f"pdserve bench: {len(failures)} of {len(warmups)} warm-up requests failed, first: "
              f"{failures[0].code}: {failures[0].message}", file=sys.stderr)


def _warn_about_context(requests: tuple[BenchRequest, ...], max_context_length: int) -> None:
    if not max_context_length:
        return  # a server that does not say
    too_long = sum(1 for r in requests if r.prompt_len is not None and r.prompt_len + r.output_len > max_context_length)
    if too_long:
        print(f"pdserve bench: {too_long} requests ask for more than the model's {max_context_length}-token context; "
              "the server may cut or refuse them", file=sys.stderr)


def _argparse(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` for ``type=``: its ValueError becomes argparse's usage error, message kept."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert
