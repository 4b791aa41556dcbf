"""Running one role (prefill, decode, colocated worker, gateway) as a server process, as the CLI starts it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path

from pdserve.security_flags import auth_token_from_args, client_tls_from_args, server_tls_from_args


def speculative_config(text: str):  # noqa: ANN201 - engine types imported lazily
    """``--speculative-config``'s value: vLLM's JSON shape, checked while the arguments are parsed."""
    from pdserve.engine.types.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.from_dict(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_speculative_config_argument(parser: argparse.ArgumentParser, whose: str = "") -> None:
    parser.add_argument(
        "--speculative-config", type=speculative_config, default=None, metavar="JSON",
        help=f"speculative decoding {whose}as in vLLM, e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        '"prompt_lookup_min": 1, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 3, "quantization": "int4"}\'; "disable_by_batch_size": N steps aside above N '
        'requests; "adaptive": true shortens or pauses each request\'s proposals where its acceptance does not pay '
        "for their measured cost (default: off)",
    )


def engine_config(args: argparse.Namespace):  # noqa: ANN202 - engine types imported lazily
    from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from pdserve.engine.types.lora import LoRAConfig

    lora = None
    if getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None):
        lora = LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                          quantization=args.quantization, quantization_group_size=args.quantization_group_size),
        cache=CacheConfig(
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
            disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        speculative_config=args.speculative_config,
        handoff_draft_kv=getattr(args, "handoff_draft_kv", False),
        # Workers only: an offline engine hands nothing off.
        kv_handoff_timeout_s=getattr(args, "kv_handoff_timeout", EngineConfig.kv_handoff_timeout_s),
        lora_config=lora,
    )


def _setup_logging(args: argparse.Namespace) -> None:
    from pdserve.service_common.logs import configure_logging

    configure_logging(args.log_level, args.log_format)


def write_ready(path: str | None, address: str, metrics_port: int | None = None) -> None:
    """The ready file: the gRPC host:port, then ``metrics PORT`` where metrics are served (the bound port,
    so ``--metrics-port 0`` can be told); ``launcher.parse_ready`` reads it."""
    if path:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(address + ("" if metrics_port is None else f"\nmetrics {metrics_port}"))
        os.replace(tmp, path)  # the launcher never reads a half-written file


def _advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_host:
        return args.advertise_host
    if args.host in ("0.0.0.0", "::", ""):
        # In a container the hostname resolves to the address peers can reach.
        return socket.gethostbyname(socket.gethostname())
    return args.host


def _serve(make_server, args: argparse.Namespace) -> int:  # noqa: ANN001
    from pdserve.service_common.server import install_uvloop, run_until_signal

    install_uvloop()

    async def run() -> int:
        server = make_server()
        try:
            port = await server.start()
        except BaseException:
            # Release what started before the failure (a bound port, the engine thread); the
            # failure itself is what the user must see, not one of this cleanup.
            with contextlib.suppress(Exception):
                await server.stop()
            raise
        host = getattr(server, "advertise_host", args.host)
        metrics = getattr(server, "metrics_endpoint", None)
        write_ready(args.ready_file, f"{host}:{port}", metrics.port if metrics is not None else None)
        # A worker whose engine died can only refuse work: exit, so that a supervisor starts a fresh one.
        if await run_until_signal(server.stop, getattr(server, "engine_dead", None)):
            return 0
        from pdserve.supervisor import EXIT_ENGINE_DEAD

        logging.getLogger("pdserve").error("the engine died; exiting with status %d to be restarted", EXIT_ENGINE_DEAD)
        return EXIT_ENGINE_DEAD

    return asyncio.run(run())


def _run_worker(args: argparse.Namespace, role: str) -> int:
    from pdserve.service_common.server import ServerConfig
    from pdserve.service_common.worker import WorkerConfig
    from pdserve.shared_cores.niceness import raise_niceness
    from pdserve.shared_cores.openmp import on_a_passing_thread

    _setup_logging(args)
    if args.niceness:
        raise_niceness(args.niceness)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    # Read before the model loads, so a wrong certificate path fails at once.
    server_tls = server_tls_from_args(args)
    client_tls = client_tls_from_args(args)  # a prefill worker dials decode workers to push KV
    # Loaded on a thread that ends, so that the engine thread is the process's only OpenMP pool: a second
    # one (the main thread's) makes every parallel region of every step sleep and wake (pdserve/shared_cores/openmp.py).
    config = engine_config(args)
    engine = on_a_passing_thread(lambda: _load_engine(config, args.lora_modules))
    server_config = ServerConfig(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                                 grace_s=args.drain_seconds, tls=server_tls,
                                 health_port=args.health_port)
    worker_config = WorkerConfig(
        role=role,
        worker_id=args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}",
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        openmp_spin=args.openmp_spin,
        batch_window_s=args.batch_window_ms / 1000,
    )
    advertise = _advertise_host(args)
    if role == "prefill":
        from pdserve.prefill_service.server import PrefillServer

        return _serve(lambda: PrefillServer(engine, server_config, worker_config,
                                            advertise_host=advertise, metrics_port=args.metrics_port,
                                            client_tls=client_tls), args)
    if role == "colocated":
        from pdserve.decode_service.colocated import ColocatedServer

        return _serve(lambda: ColocatedServer(engine, server_config, worker_config,
                                              advertise_host=advertise, kv_failure_policy=args.kv_failure_policy,
                                              client_tls=client_tls, metrics_port=args.metrics_port), args)
    from pdserve.decode_service.server import DecodeServer

    return _serve(lambda: DecodeServer(engine, server_config, worker_config, advertise_host=advertise,
                                       kv_failure_policy=args.kv_failure_policy, client_tls=client_tls,
                                       metrics_port=args.metrics_port), args)


def _load_engine(config, lora_modules):  # noqa: ANN001, ANN202 - engine types imported lazily
    """The worker's engine, with its ``--lora-modules`` read into host memory (a bad adapter fails the start,
    naming it); ids in flag order, as the gateway gives them."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.types.lora import LoRARequest

    engine = LLMEngine(config)
    for index, module in enumerate(lora_modules, start=1):
        engine.lora.load(LoRARequest(module.name, index, module.path))
    return engine


def run_prefill(args: argparse.Namespace) -> int:
    return _run_worker(args, "prefill")


def run_decode(args: argparse.Namespace) -> int:
    return _run_worker(args, "decode")


def run_colocated(args: argparse.Namespace) -> int:
    return _run_worker(args, "colocated")


def run_gateway(args: argparse.Namespace) -> int:
    from pdserve.engine.structured_output import set_check_timeout
    from pdserve.gateway.decode_stream import MigrationPolicy
    from pdserve.gateway.lora import LoRAAdapters
    from pdserve.gateway.server import GatewayServer
    from pdserve.gateway.tokenizer import load_tokenizer
    from pdserve.service_common.server import ServerConfig

    _setup_logging(args)
    if not args.prefill and not args.decode and not args.redis_url:
        raise ValueError("the gateway needs workers: give --prefill/--decode addresses or --redis-url")
    server_config = ServerConfig(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                                 grace_s=args.drain_seconds, tls=server_tls_from_args(args),
                                 auth_token=auth_token_from_args(args), health_port=args.health_port)
    client_tls = client_tls_from_args(args)
    tokenizer = load_tokenizer(args.model)
    set_check_timeout(args.structured_outputs_timeout)
    lora_adapters = LoRAAdapters(args.lora_modules, enabled=args.enable_lora,
                                 allow_runtime_updating=args.allow_runtime_lora_updating)

    class _Gateway(GatewayServer):
        advertise_host = args.host

        async def start(self) -> int:
            port = await super().start()
            if not await self.pool.wait_ready(args.wait_for_workers):
                logging.getLogger("pdserve").warning("no prefill and decode worker answered yet; serving anyway")
            return port

    return _serve(lambda: _Gateway(server_config, tokenizer, args.prefill, args.decode, args.redis_url,
                                   args.redis_prefix, args.kv_transport, routing=args.routing,
                                   disaggregation=args.disaggregation, max_tpot_increase=args.max_tpot_increase,
                                   max_logprobs=args.max_logprobs, max_inflight_requests=args.max_inflight_requests,
                                   max_inflight_tokens=args.max_inflight_tokens, client_tls=client_tls,
                                   http_port=args.http_port, metrics_port=args.metrics_port, http_max_n=args.max_n,
                                   http_max_body_bytes=args.http_max_body_bytes, kv_push=args.kv_push,
                                   tool_call_parser=tool_call_parser_from_args(args),
                                   reasoning_parser=args.reasoning_parser, lora_adapters=lora_adapters,
                                   migration=MigrationPolicy(args.max_migrations, args.migration_timeout)), args)


def tool_call_parser_from_args(args: argparse.Namespace) -> str | None:
    """The parser of ``tool_choice: "auto"``, as vLLM takes it: ``--enable-auto-tool-choice`` with a
    ``--tool-call-parser``; ``ValueError`` when one comes without the other."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs a --tool-call-parser (hermes, llama3_json, mistral)")
    if args.tool_call_parser and not args.enable_auto_tool_choice:
        raise ValueError("--tool-call-parser is used for tool_choice \"auto\": add --enable-auto-tool-choice")
    return args.tool_call_parser if args.enable_auto_tool_choice else None
