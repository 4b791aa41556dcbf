"""The ``pdserve`` console script: every subcommand's arguments; offline and generate run here,
each service role in ``pdserve.serve``, a local cluster in ``pdserve.up``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

from pdserve.gateway.decode_stream import DEFAULT_MAX_MIGRATIONS, DEFAULT_MIGRATION_TIMEOUT_S
from pdserve.gateway.disaggregation import MODES as DISAGGREGATION_MODES
from pdserve.security_flags import (
    add_auth_token_argument,
    add_client_tls_arguments,
    add_server_tls_arguments,
    auth_token_from_args,
    client_tls_from_args,
)
from pdserve.serve import (
    add_speculative_config_argument,
    engine_config,
    run_colocated,
    run_decode,
    run_gateway,
    run_prefill,
)
from pdserve.up import DEFAULT_BATCH_WINDOW_MS, DEFAULT_HTTP_PORT, DEFAULT_KV_HANDOFF_TIMEOUT_S, run_up

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three primary colours.",
)
TRANSPORTS = ("grpc", "shm", "torch_dist", "cuda_ipc")


# ---- arguments ---------------------------------------------------------------------------



def _niceness(text: str) -> int:
    try:
        value = int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from error
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"must be 0-19 (a worker can only lower its own priority), got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from error
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value

def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


class _RenamedFlag(argparse.Action):
    """An old flag name that still works, with a warning that names the new one."""

    def __init__(self, option_strings: list[str], dest: str, new_name: str = "", **kwargs: object) -> None:
        self.new_name = new_name
        super().__init__(option_strings, dest, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        print(f"pdserve: warning: {option_string} is deprecated; use {self.new_name}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="local folder, GGUF file or hub id (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: bfloat16 on GPUs and on CPUs with native bf16 (AMX or AVX512-BF16), float32 on "
                             "other CPUs; float32 is the exactness oracle (token for token transformers' output)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8"],
                        help="what the KV pool stores: auto (the model's dtype), bfloat16, or int8 with a "
                        "float32 scale per token and KV head (about 4x the blocks of float32 in the same memory)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: from free memory)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        help="keep every KV block in sliding-window layers too (by default the blocks a window "
                        "has left behind are freed in those layers)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="run the model over N ranks (this process and N-1 it starts; gloo on CPU, NCCL on "
                        "N GPUs from --device): attention heads and MLP split Megatron-style (default: 1)")
    _add_quantization_args(parser)
    add_speculative_config_argument(parser)


def _add_quantization_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"],
                        help="weight-only quantization of the decoder's projections at load (default: none)")
    parser.add_argument("--quantization-group-size", type=int, default=32,
                        help="input columns per INT4 scale and zero (32, 64, 128 or 256; must divide the projections)")


def _add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=default_port, help="0 picks an ephemeral port")
    parser.add_argument("--redis-url", default=None, help="Redis for the worker registry and prefix index (default: none)")
    parser.add_argument("--redis-prefix", default="pdserve", help="namespace of every Redis key")
    parser.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--ready-file", default=None,
                        help="write host:port here once serving (and a line `metrics PORT` where metrics are served)")
    parser.add_argument("--drain-seconds", type=float, default=30.0,
                        help="on SIGTERM: refuse new calls, let running ones finish for this long, then exit")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="log lines as text or one JSON object each; both carry the request id")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --host "
                        "(default: off; 0 picks an ephemeral port)")
    parser.add_argument("--health-port", type=int, default=None,
                        help="also serve the gRPC health service alone, in plaintext, on HOST:PORT, HOST being "
                        "--host: for probes that cannot speak TLS, e.g. Kubernetes' (default: off; health is "
                        "always on the main port too)")
    add_server_tls_arguments(parser)


def _add_lora_args(parser: argparse.ArgumentParser, whose: str, engine: bool = True, gateway: bool = False) -> None:
    from pdserve.gateway.lora import add_lora_engine_arguments, add_lora_module_arguments

    group = parser.add_argument_group("LoRA adapters", "many fine-tunes of the model served in one batch "
                                      "(docs/models.md, LoRA adapters)")
    add_lora_module_arguments(group, whose)  # type: ignore[arg-type]
    if engine:
        add_lora_engine_arguments(group)  # type: ignore[arg-type]
    if gateway:
        group.add_argument("--allow-runtime-lora-updating", action="store_true",
                           help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints, "
                           "which vLLM enables with VLLM_ALLOW_RUNTIME_LORA_UPDATING; default: off)")


def _add_worker_args(parser: argparse.ArgumentParser, role: str, default_port: int) -> None:
    _add_engine_args(parser)
    _add_server_args(parser, default_port)
    _add_lora_args(parser, "on this worker; --lora-modules are read at start ")
    parser.add_argument("--advertise-host", default=None,
                        help="host other processes use to reach this worker (default: --host, or this "
                        "machine's address when binding 0.0.0.0)")
    parser.add_argument("--worker-id", default=None, help=f"stable id (default: {role}-<hostname>-<pid>)")
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="admission limit: requests queued here before new ones get RESOURCE_EXHAUSTED")
    parser.add_argument("--max-queued-tokens", type=int, default=65536,
                        help="admission limit: prompt tokens queued here before new requests get RESOURCE_EXHAUSTED")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's, one per core; the workers `pdserve up` starts "
                        "on one machine each take that many)")
    parser.add_argument("--openmp-spin", default="adaptive", choices=["adaptive", "libgomp"],
                        help="adaptive: torch's OpenMP threads spin between parallel regions only while other "
                        "processes leave this worker's CPUs idle, and sleep at once while they compute there (read "
                        "from /proc/stat every 0.2 s); libgomp: as OMP_WAIT_POLICY and GOMP_SPINCOUNT say. "
                        "OMP_WAIT_POLICY=PASSIVE turns spinning off either way (default: adaptive)")
    parser.add_argument("--batch-window-ms", type=_non_negative_float, default=DEFAULT_BATCH_WINDOW_MS,
                        help="an idle worker that gets a prompt waits while more requests keep arriving (each within "
                        "5 ms of the last: pdserve/engine/batch_window.py's ARRIVAL_GAP_S), up to this long, before its first "
                        "step, unless that step is full already: a burst then starts as one batch; a request arriving "
                        "alone waits 5 ms. A decode worker also holds a step, up to this long, for requests whose "
                        "pushed KV has fully landed and whose start is on its way, so that a prefill step's requests "
                        "join one step; while streams run, only as long as that costs them less than it saves the "
                        "arriving requests. 0: off (default: %(default)g)")
    parser.add_argument("--niceness", type=_niceness, default=0,
                        help="raise this worker's niceness by N (0-19) at start, threads and TP ranks included: on a "
                        "machine shared with other workers it then gets the cores only when they leave them idle "
                        "(`pdserve up --prefill-niceness`; default 0)")
    parser.add_argument("--kv-handoff-timeout", type=_positive_float, default=DEFAULT_KV_HANDOFF_TIMEOUT_S,
                        metavar="SECONDS",
                        help="the one deadline for what a KV handoff holds that nobody claims: a prefill worker's "
                        "lease on a finished prompt's KV (no decode worker took it), KV pushed to a decode worker "
                        "whose request never came, a request a decode worker started on its push that no Decode "
                        "claimed. Each is freed then; the metric pdserve_kv_handoff_expired_total counts them. "
                        "Prefill and colocated workers still take its former name, --lease-seconds "
                        "(default: %(default)g)")
    if role in ("prefill", "colocated"):
        parser.add_argument("--lease-seconds", dest="kv_handoff_timeout", type=_positive_float, new_name=
                            "--kv-handoff-timeout", action=_RenamedFlag, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _add_supervision_args(parser: argparse.ArgumentParser) -> None:
    from pdserve.supervisor import RestartPolicy

    default = RestartPolicy()
    group = parser.add_argument_group("supervision", "a child that exits or stops serving is restarted on its port")
    group.add_argument("--restart-delay", type=float, default=default.initial_backoff_s, metavar="S",
                       help="seconds before the first restart, doubled with each restart in the window "
                       "(systemd's RestartSec)")
    group.add_argument("--restart-max-delay", type=float, default=default.max_backoff_s, metavar="S",
                       help="cap of that delay (systemd's RestartMaxDelaySec)")
    group.add_argument("--max-restarts", type=int, default=default.max_restarts, metavar="N",
                       help="restarts of one child allowed within --restart-window; one more exit stops the "
                       "cluster with an error (systemd's StartLimitBurst)")
    group.add_argument("--restart-window", type=float, default=default.window_s, metavar="S",
                       help="the window --max-restarts counts in (systemd's StartLimitIntervalSec)")
    group.add_argument("--unhealthy-after", type=float, default=default.unhealthy_after_s, metavar="S",
                       help="a child whose health is NOT_SERVING or unanswered this long is killed and restarted")
    group.add_argument("--start-timeout", type=float, default=default.start_timeout_s, metavar="S",
                       help="seconds a child may take to become ready, at start and after a restart (systemd's "
                       "TimeoutStartSec); raise it on a heavily loaded machine")


def _tool_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.engine.structured_output import DEFAULT_CHECK_TIMEOUT_S
    from pdserve.gateway.reasoning_parsers import PARSERS as REASONING_PARSERS
    from pdserve.gateway.tool_parsers import PARSERS

    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto" on the HTTP API: tool calls found in the answer with '
                             "--tool-call-parser (required and named tool choices need neither flag)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="the format the model writes tool calls in, for tool_choice \"auto\"")
    parser.add_argument("--structured-outputs-timeout", type=_positive_float, default=DEFAULT_CHECK_TIMEOUT_S,
                        help="seconds a request's JSON schema, regex or grammar may take to compile before it is "
                             f"refused (400, INVALID_ARGUMENT; default {DEFAULT_CHECK_TIMEOUT_S:g})")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="chat answers split into reasoning_content (the <think>...</think> part) and content; "
                             "structured output then holds the answer only")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with disaggregated prefill and decode")
    commands = parser.add_subparsers(dest="command", required=True)

    offline = commands.add_parser("offline", help="generate chat completions in this process and print them")
    _add_engine_args(offline)
    offline.add_argument("prompt", nargs="*", help="user messages (default: a few demo questions)")
    offline.add_argument("--max-tokens", type=int, default=64)
    offline.add_argument("--temperature", type=float, default=0.0)
    offline.add_argument("--seed", type=int, default=None)
    offline.set_defaults(func=_run_offline)

    prefill = commands.add_parser("prefill", help="run a prefill worker")
    _add_worker_args(prefill, "prefill", 50061)
    prefill.add_argument("--handoff-draft-kv", action="store_true",
                         help="with a draft_model --speculative-config: build the draft's prompt KV here beside the "
                         "target's and hand both over (default: the decode worker recomputes it)")
    add_client_tls_arguments(prefill, "decode workers (KV push)")
    prefill.set_defaults(func=run_prefill)

    decode = commands.add_parser("decode", help="run a decode worker")
    _add_worker_args(decode, "decode", 50071)
    add_client_tls_arguments(decode, "prefill workers")
    decode.add_argument("--kv-failure-policy", default="recompute", choices=["recompute", "fail"],
                        help="when a handoff's KV cannot be fetched: recompute the prompt here, or fail with UNAVAILABLE")
    decode.set_defaults(func=run_decode)

    colocated = commands.add_parser("colocated", help="run a worker doing prefill and decode on one engine")
    _add_worker_args(colocated, "colocated", 50081)
    add_client_tls_arguments(colocated, "prefill workers (itself included)")
    colocated.add_argument("--kv-failure-policy", default="recompute", choices=["recompute", "fail"])
    colocated.set_defaults(func=run_colocated)

    gateway = commands.add_parser("gateway", help="run the public gateway")
    _add_server_args(gateway, 50051)
    add_client_tls_arguments(gateway, "workers")
    add_auth_token_argument(gateway, "refuse calls (UNAUTHENTICATED) that do not carry")
    gateway.add_argument("--model", default=None, help="model whose tokenizer serves text prompts (default: embedded)")
    gateway.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", help="a prefill worker (repeatable)")
    gateway.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="a decode worker (repeatable)")
    gateway.add_argument("--kv-transport", default="grpc", choices=TRANSPORTS)
    gateway.add_argument("--kv-push", action=argparse.BooleanOptionalAction, default=True,
                         help="choose the decode worker before the prefill and have the prefill worker push the KV "
                         "to it as each layer is computed (grpc, shm; other transports are pulled)")
    gateway.add_argument("--routing", default="prefix", choices=["prefix", "round_robin"],
                         help="prefill choice: longest cached prefix weighed against load, or round-robin")
    gateway.add_argument("--disaggregation", default="auto", choices=DISAGGREGATION_MODES,
                         help="where prompts are prefilled: always on a prefill worker (then KV handoff), never (on the decode worker), "
                         "or auto: per request, from the uncached prompt length, the decode worker's prefix-cache hit, "
                         "both sides' queues and measured prefill, handoff and decode costs (default auto)")
    gateway.add_argument("--max-tpot-increase", type=_non_negative_float, default=0.1,
                         help="auto: the most that local prefills may add, together over a stream's life, to the time "
                         "per output token of the streams running on a decode worker, as a fraction (default 0.1)")
    gateway.add_argument("--wait-for-workers", type=float, default=60.0, help="seconds to wait for workers at start")
    gateway.add_argument("--max-inflight-requests", type=int, default=1024,
                         help="admission limit: requests in flight before new ones get RESOURCE_EXHAUSTED")
    gateway.add_argument("--max-inflight-tokens", type=int, default=1 << 20,
                         help="admission limit: prompt tokens in flight before new requests get RESOURCE_EXHAUSTED")
    gateway.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs a request may ask for")
    gateway.add_argument("--http-port", type=int, default=None,
                         help="also serve the OpenAI-compatible HTTP API (/v1/...) on this port of --host (default: off); "
                              "HTTPS with --tls-cert/--tls-key (and client certificates with --tls-client-ca) when given")
    gateway.add_argument("--max-n", type=int, default=16,
                         help="largest n (choices per request) the HTTP API accepts; each choice is one generation")
    gateway.add_argument("--http-max-body-bytes", type=int, default=8 << 20,
                         help="largest HTTP request body; larger ones are answered 413 unread")
    gateway.add_argument("--max-migrations", type=int, default=DEFAULT_MAX_MIGRATIONS,
                         help="times a stream moves to another decode worker when its own fails mid-stream (the "
                         "new one computes the tokens sent so far and continues exactly); 0: such streams end "
                         "with UNAVAILABLE (default 3)")
    gateway.add_argument("--migration-timeout", type=_positive_float, default=DEFAULT_MIGRATION_TIMEOUT_S, metavar="S",
                         help="the longest a stream waits, from its decode worker failing, for another's first token "
                         "across its moves; then UNAVAILABLE (default 60)")
    _tool_arguments(gateway)
    _add_lora_args(gateway, "(the workers need --enable-lora too) ", engine=False, gateway=True)
    gateway.set_defaults(func=run_gateway)

    up = commands.add_parser("up", help="start Redis (if needed), workers and gateway on this machine")
    up.add_argument("--model", default=None)
    up.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="model dtype of every worker (see `pdserve offline --help`)")
    up.add_argument("--device", default="auto")
    _add_quantization_args(up)
    up.add_argument("--prefill-tp", type=int, default=1,
                    help="--tensor-parallel-size of every prefill worker (its ranks start and stop with it)")
    up.add_argument("--decode-tp", type=int, default=1,
                    help="--tensor-parallel-size of every decode and colocated worker; may differ from "
                    "--prefill-tp (handoffs re-shard the KV heads)")
    up.add_argument("--prefill-workers", type=int, default=1)
    up.add_argument("--prefill-niceness", type=_niceness, default=0,
                    help="--niceness of every prefill worker: on this machine its prefills then take the cores the "
                    "decode workers leave idle, so decode steps slow down less while prompts compute, and a prompt "
                    "may wait longer for its first token (docs/performance.md has the measured trade-off; default 0: "
                    "equal shares)")
    up.add_argument("--decode-workers", type=int, default=1)
    up.add_argument("--colocated-workers", type=int, default=0,
                    help="run N workers doing both prefill and decode instead of separate ones")
    up.add_argument("--routing", default="prefix", choices=["prefix", "round_robin"])
    up.add_argument("--disaggregation", default="auto", choices=DISAGGREGATION_MODES,
                    help="the gateway's --disaggregation: always | never | auto (default auto)")
    up.add_argument("--max-tpot-increase", type=_non_negative_float, default=0.1,
                    help="the gateway's --max-tpot-increase: auto's stall budget for local prefills (default 0.1)")
    up.add_argument("--host", default="127.0.0.1", help="address the gateway binds")
    up.add_argument("--port", type=int, default=50051)
    up.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                    help=f"the gateway's OpenAI-compatible HTTP API, on --host (default {DEFAULT_HTTP_PORT}, as "
                         "`vllm serve`; 0: any free port)")
    up.add_argument("--no-http", action="store_true", help="serve gRPC only: no OpenAI-compatible HTTP API")
    up.add_argument("--max-n", type=int, default=None, help="largest n the HTTP API accepts (default: the gateway's, 16)")
    _tool_arguments(up)
    up.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    up.add_argument("--redis-prefix", default="pdserve")
    up.add_argument("--kv-transport", default="grpc", choices=TRANSPORTS)
    up.add_argument("--kv-push", action=argparse.BooleanOptionalAction, default=True,
                    help="the gateway's --kv-push: KV pushed while the prefill runs (grpc, shm), else pulled")
    up.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size of every worker")
    up.add_argument("--batch-window-ms", type=_non_negative_float, default=DEFAULT_BATCH_WINDOW_MS,
                    help="every worker's --batch-window-ms: how long an idle worker may wait for the rest of a burst "
                    "before its first step, and a decode worker for requests whose pushed KV has landed "
                    "(0: off; default: %(default)g)")
    up.add_argument("--kv-handoff-timeout", type=_positive_float, default=DEFAULT_KV_HANDOFF_TIMEOUT_S,
                    metavar="SECONDS",
                    help="every worker's --kv-handoff-timeout: how long a handoff may hold KV nobody claims "
                    "(default: %(default)g)")
    up.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8"],
                    help="KV cache dtype of every worker (see `pdserve offline --help`)")
    up.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                    help="every worker keeps every KV block in sliding-window layers too")
    add_speculative_config_argument(up, "of every decode and colocated worker (prefill workers do not decode); ")
    up.add_argument("--draft-prompt-kv", default="recompute", choices=["recompute", "prefill"],
                    help="with a draft_model --speculative-config, where the draft's prompt KV is built: recomputed "
                    "by the decode worker, or on the prefill worker beside the target's and handed over with it "
                    "(the prefill workers load the draft too); see BENCHMARKS.md (default recompute)")
    up.add_argument("--metrics-port", type=int, default=None,
                    help="Prometheus /metrics of every process: the gateway on this port, the workers on the next "
                    "ones in start order (0: a free port each); listed at start (default: off)")
    up.add_argument("--max-migrations", type=int, default=DEFAULT_MAX_MIGRATIONS,
                    help="the gateway's --max-migrations: moves of a stream whose decode worker fails (default 3)")
    up.add_argument("--migration-timeout", type=_positive_float, default=DEFAULT_MIGRATION_TIMEOUT_S, metavar="S",
                    help="the gateway's --migration-timeout (default 60)")
    _add_lora_args(up, "on every worker ", gateway=True)
    _add_supervision_args(up)
    up.set_defaults(func=run_up)

    from pdserve.bench import add_bench_arguments, run_bench

    bench = commands.add_parser("bench", help="drive a running gateway with streamed requests; report serving metrics")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)

    generate = commands.add_parser("generate", help="stream a completion from a running gateway")
    generate.add_argument("prompt")
    generate.add_argument("--target", default="127.0.0.1:50051")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--timeout", type=float, default=120.0)
    generate.add_argument("--lora-name", default=None, help="the LoRA adapter to generate under (default: the base)")
    add_client_tls_arguments(generate, "the gateway")
    add_auth_token_argument(generate, "send")
    generate.set_defaults(func=_run_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"pdserve: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        # A port in use, a missing file: one line a person can act on, not a traceback.
        print(f"pdserve: error: {error}", file=sys.stderr)
        return 1


# ---- offline -----------------------------------------------------------------------------


def _run_offline(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM.from_config(engine_config(args))
    engine = llm.engine
    print(f"loaded {engine.model_id} in {time.perf_counter() - start:.1f} s "
          f"({engine.dtype}, {engine.device}, {engine.block_manager.num_blocks} KV blocks)")
    questions = args.prompt or list(DEMO_QUESTIONS)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    elapsed = time.perf_counter() - start
    for question, out in zip(questions, outputs):
        print(f"\n>>> {question}\n{out.text.strip()}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} completions, {total} output tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s")
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
    from pdserve.service_common.security import bearer_metadata, open_channel
    from pdserve.service_common.server import channel_options

    params = generation_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        params.seed = args.seed
    tls, metadata = client_tls_from_args(args), bearer_metadata(auth_token_from_args(args))

    async def run() -> int:
        async with open_channel(args.target, tls, channel_options()) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(prompt=args.prompt, sampling_params=params,
                                                     lora_name=args.lora_name or "")
            start = time.perf_counter()
            first_at = None
            usage, reason = None, "unfinished"
            try:
                async for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                    first_at = first_at or time.perf_counter()
                    print(response.text, end="", flush=True)
                    if response.HasField("usage"):
                        usage, reason = response.usage, generation_pb2.FinishReason.Name(response.finish_reason)
            except grpc.aio.AioRpcError as error:
                print(f"\npdserve: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1
            elapsed = time.perf_counter() - start
            if usage is None or first_at is None:
                print("\npdserve: the stream ended without a final response", file=sys.stderr)
                return 1
            print(f"\n[{usage.completion_tokens} tokens, {reason}, prompt {usage.prompt_tokens} "
                  f"({usage.cached_prompt_tokens} cached), TTFT {(first_at - start) * 1000:.0f} ms, {elapsed:.2f} s]")
            return 0

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
