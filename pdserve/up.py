"""``pdserve up``: a whole cluster on this machine, supervised until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys


# A worker's --batch-window-ms (and up's) when not given: how long an idle worker may wait for the rest of a burst,
# and a decode step for requests whose pushed KV has landed.
DEFAULT_BATCH_WINDOW_MS = 30.0
# A worker's --kv-handoff-timeout (and up's) when not given: EngineConfig.kv_handoff_timeout_s's default.
DEFAULT_KV_HANDOFF_TIMEOUT_S = 30.0
# The OpenAI-compatible HTTP API's port in `pdserve up` (vLLM's `vllm serve` default); --no-http turns it off.
DEFAULT_HTTP_PORT = 8000


def up_engine_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags ``up`` passes on to every worker it starts."""
    engine_args: tuple[str, ...] = ("--num-kv-blocks", str(args.num_kv_blocks)) if args.num_kv_blocks else ()
    if args.batch_window_ms != DEFAULT_BATCH_WINDOW_MS:
        engine_args += ("--batch-window-ms", f"{args.batch_window_ms:g}")
    if args.kv_handoff_timeout != DEFAULT_KV_HANDOFF_TIMEOUT_S:
        engine_args += ("--kv-handoff-timeout", f"{args.kv_handoff_timeout:g}")
    if args.quantization:
        engine_args += ("--quantization", args.quantization, "--quantization-group-size", str(args.quantization_group_size))
    if args.kv_cache_dtype != "auto":
        engine_args += ("--kv-cache-dtype", args.kv_cache_dtype)
    if args.disable_hybrid_kv_cache_manager:
        engine_args += ("--disable-hybrid-kv-cache-manager",)
    return engine_args + up_lora_worker_args(args)


def up_lora_worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The LoRA flags ``up`` passes on to every worker: on, the slot and host-memory sizes, the adapters to read."""
    if not (args.enable_lora or args.lora_modules or args.allow_runtime_lora_updating):
        return ()
    lora_args: tuple[str, ...] = ("--enable-lora", "--max-loras", str(args.max_loras),
                                  "--max-lora-rank", str(args.max_lora_rank))
    if args.max_cpu_loras is not None:
        lora_args += ("--max-cpu-loras", str(args.max_cpu_loras))
    if args.lora_modules:
        lora_args += ("--lora-modules", *(module.to_arg() for module in args.lora_modules))
    return lora_args


def up_lora_gateway_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The LoRA flags ``up`` passes on to the gateway: the adapters requests may name, runtime updating."""
    if not (args.enable_lora or args.lora_modules or args.allow_runtime_lora_updating):
        return ()
    gateway_args: tuple[str, ...] = ("--enable-lora",)
    if args.lora_modules:
        gateway_args += ("--lora-modules", *(module.to_arg() for module in args.lora_modules))
    if args.allow_runtime_lora_updating:
        gateway_args += ("--allow-runtime-lora-updating",)
    return gateway_args


def up_decode_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags ``up`` passes on to the workers that decode (decode and colocated) only."""
    decode_args: tuple[str, ...] = ()
    if args.decode_tp != 1:
        decode_args += ("--tensor-parallel-size", str(args.decode_tp))
    if args.speculative_config is None:
        return decode_args
    return decode_args + ("--speculative-config", args.speculative_config.to_json())


def up_prefill_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags ``up`` passes on to prefill workers only: their niceness, their tensor parallelism, and
    the draft when they build its prompt KV."""
    prefill_args: tuple[str, ...] = ("--niceness", str(args.prefill_niceness)) if args.prefill_niceness else ()
    if args.prefill_tp != 1:
        prefill_args += ("--tensor-parallel-size", str(args.prefill_tp))
    if args.draft_prompt_kv == "recompute":
        return prefill_args
    if args.speculative_config is None or args.speculative_config.method != "draft_model":
        raise ValueError("--draft-prompt-kv prefill needs a draft_model --speculative-config (the draft to run)")
    return prefill_args + ("--speculative-config", args.speculative_config.to_json(), "--handoff-draft-kv")


def run_up(args: argparse.Namespace) -> int:
    import signal

    from pdserve.launcher import ClusterConfig, LocalCluster, StartupError
    from pdserve.serve import tool_call_parser_from_args
    from pdserve.supervisor import GaveUp, RestartPolicy, Supervisor

    logging.basicConfig(level="INFO", format="%(message)s")
    policy = RestartPolicy(initial_backoff_s=args.restart_delay, max_backoff_s=args.restart_max_delay,
                           max_restarts=args.max_restarts, window_s=args.restart_window,
                           unhealthy_after_s=args.unhealthy_after, start_timeout_s=args.start_timeout)
    engine_args = up_engine_args(args)
    config = ClusterConfig(
        model=args.model, metrics_port=args.metrics_port, dtype=args.dtype, device=args.device,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers, host=args.host, port=args.port, redis_url=args.redis_url,
        redis_prefix=args.redis_prefix, kv_transport=args.kv_transport, kv_push=args.kv_push, engine_args=engine_args,
        decode_args=up_decode_args(args), prefill_args=up_prefill_args(args),
        colocated_workers=args.colocated_workers, routing=args.routing, disaggregation=args.disaggregation,
        max_tpot_increase=args.max_tpot_increase,
        http_port=None if args.no_http else args.http_port, http_max_n=args.max_n, start_timeout_s=args.start_timeout,
        tool_call_parser=tool_call_parser_from_args(args), reasoning_parser=args.reasoning_parser,
        structured_outputs_timeout_s=args.structured_outputs_timeout,
        gateway_args=("--max-migrations", str(args.max_migrations), "--migration-timeout", f"{args.migration_timeout:g}",
                      *up_lora_gateway_args(args)),
    )
    stop = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    cluster = LocalCluster(config)
    try:
        cluster.start()
        print(startup_line(args, cluster), flush=True)
        for name in cluster.child_names():
            print(f"  {name}: {cluster.location(name)} (pid {cluster.process(name).pid})", flush=True)
        Supervisor(cluster, policy).run(lambda: stop)
        return 0
    except (StartupError, GaveUp) as error:
        print(f"pdserve: error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        cluster.stop()
        print("pdserve stopped", flush=True)


def _tp_note(args: argparse.Namespace) -> str:
    if args.prefill_tp == 1 and args.decode_tp == 1:
        return ""
    return f", tensor parallel: prefill {args.prefill_tp}, decode {args.decode_tp}"


def startup_line(args: argparse.Namespace, cluster) -> str:  # noqa: ANN001 - LocalCluster, imported lazily
    layout = (f"{args.colocated_workers} colocated" if args.colocated_workers
              else f"{args.prefill_workers} prefill, {args.decode_workers} decode")
    line = (f"pdserve is serving {args.model or 'the default model'} on {cluster.endpoint} "
            f"({layout}{_tp_note(args)}, transport {args.kv_transport}); try: pdserve generate 'Hello' --target {cluster.endpoint}")
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    if not args.no_http and args.http_port:
        line += f"; OpenAI API: http{'s' if getattr(args, 'tls_cert', None) else ''}://{host}:{args.http_port}/v1"
    if getattr(args, "lora_modules", None):
        line += f"; LoRA adapters (the model field): {', '.join(module.name for module in args.lora_modules)}"
    if cluster.metrics_ports:
        listed = ", ".join(f"{name} http://{host}:{port}/metrics" for name, port in cluster.metrics_ports.items())
        line += f"; metrics: {listed}"
    return line
