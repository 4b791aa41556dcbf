"""Starts a whole cluster on this machine as processes: Redis (if needed), workers, gateway.

Every process binds loopback and an ephemeral port, and reports the port it got
through a ready file; the launcher waits for each, then starts the gateway with
the workers' addresses. ``respawn()`` starts a child again with its arguments on
the port it had (``pdserve.supervisor`` decides when). ``stop()`` sends SIGTERM
to every process it started (by PID), waits, and kills what has not exited.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from pdserve.service_common.server import port_free

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    """What ``pdserve up`` starts."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    prefill_workers: int = 1
    decode_workers: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = None  # the gateway's OpenAI-compatible HTTP API; None: off
    http_max_n: int | None = None  # the most choices one HTTP request may ask for; None: the gateway's default
    tool_call_parser: str | None = None  # the gateway's tool_choice "auto" parser; None: off
    reasoning_parser: str | None = None  # the gateway's --reasoning-parser; None: off
    structured_outputs_timeout_s: float | None = None  # the gateway's --structured-outputs-timeout; None: its default
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "pdserve"
    kv_transport: str = "grpc"
    kv_push: bool = True  # the gateway's --kv-push
    colocated_workers: int = 0  # > 0: workers doing prefill and decode, instead of separate roles
    routing: str = "prefix"  # or "round_robin"
    disaggregation: str = "auto"  # the gateway's --disaggregation: always | never | auto
    max_tpot_increase: float = 0.1  # the gateway's --max-tpot-increase (auto's stall budget)
    engine_args: tuple[str, ...] = ()  # passed to every worker (e.g. --num-kv-blocks 256)
    gateway_args: tuple[str, ...] = ()  # passed to the gateway (e.g. --lora-modules a=/path)
    decode_args: tuple[str, ...] = ()  # passed to decode and colocated workers only (e.g. --speculative-config)
    # Passed to prefill workers only (e.g. --tensor-parallel-size, --handoff-draft-kv: a worker starts and stops
    # its own ranks, so a killed worker takes them down and a restart brings the whole worker back).
    prefill_args: tuple[str, ...] = ()
    # Prometheus /metrics of every process started: the gateway on this port, the workers on the
    # next ones in start order (prefill-0.., decode-0..); 0: a free port each. None: off.
    metrics_port: int | None = None
    start_timeout_s: float = 300.0
    extra_env: dict[str, str] = field(default_factory=dict)


class StartupError(RuntimeError):
    """The cluster could not start; the message is one line naming the cause and what to change."""


def redis_answers(url: str, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at the URL's host and port."""
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=timeout_s):
            return True
    except OSError:
        return False


class LocalCluster:
    """The processes of one local cluster; use as a context manager or call start/stop."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._commands: dict[str, list[str]] = {}  # each child's argv, its --port pinned once it bound one
        self.addresses: dict[str, str] = {}
        self.metrics_ports: dict[str, int] = {}
        self._tmp = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.redis_url: str | None = config.redis_url
        self.prefill_addresses: list[str] = []
        self.decode_addresses: list[str] = []
        self.endpoint = ""
        self._health: dict[str, HealthProbe] = {}

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        """Start everything; returns the gateway's host:port. Raises ``StartupError`` with a one-line cause."""
        config = self.config
        workers = self.worker_names()
        self._assign_metrics_ports(["gateway", *(name for _, name in workers)])
        self._check_ports_free()
        self._ensure_redis()
        redis_args = ["--redis-url", self.redis_url, "--redis-prefix", config.redis_prefix] if self.redis_url else []
        common = ["--host", config.host, "--port", "0", *redis_args, "--dtype", config.dtype, "--device", config.device]
        if config.model:
            common += ["--model", config.model]
        for role, name in workers:
            ready = self._ready_file(name)
            role_args = config.decode_args if role in ("decode", "colocated") else config.prefill_args
            self._spawn(name, [role, *common, "--worker-id", name, "--ready-file", str(ready), *self._metrics_args(name),
                               *config.engine_args, *role_args])
        for role, name in workers:
            address = self._wait_ready(name)
            if role in ("prefill", "colocated"):
                self.prefill_addresses.append(address)
            if role in ("decode", "colocated"):
                self.decode_addresses.append(address)
        gateway_args = ["gateway", "--host", config.host, "--port", str(config.port), *redis_args,
                        "--kv-transport", config.kv_transport, "--routing", config.routing,
                        "--disaggregation", config.disaggregation,
                        "--max-tpot-increase", str(config.max_tpot_increase),
                        "--kv-push" if config.kv_push else "--no-kv-push",
                        "--ready-file", str(self._ready_file("gateway")), *self._metrics_args("gateway")]
        if config.model:
            gateway_args += ["--model", config.model]
        if config.http_port is not None:
            gateway_args += ["--http-port", str(config.http_port)]
        if config.http_max_n is not None:
            gateway_args += ["--max-n", str(config.http_max_n)]
        if config.tool_call_parser is not None:
            gateway_args += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
        if config.reasoning_parser is not None:
            gateway_args += ["--reasoning-parser", config.reasoning_parser]
        if config.structured_outputs_timeout_s is not None:
            gateway_args += ["--structured-outputs-timeout", repr(config.structured_outputs_timeout_s)]
        gateway_args += config.gateway_args
        for address in self.prefill_addresses:
            gateway_args += ["--prefill", address]
        for address in self.decode_addresses:
            gateway_args += ["--decode", address]
        self._spawn("gateway", gateway_args)
        self.endpoint = self._wait_ready("gateway")
        return self.endpoint

    def start_gateway(self, name: str, extra_args: Sequence[str] = ()) -> str:
        """Another gateway over this cluster's workers, on a free port, with ``extra_args`` added to the
        first one's flags (e.g. ``--no-kv-push``, for a side-by-side comparison); its endpoint. Stopped
        with the cluster."""
        command = [*self._commands["gateway"], "--port", "0", "--ready-file", str(self._ready_file(name)),
                   *(["--metrics-port", "0"] if "gateway" in self.metrics_ports else []), *extra_args]
        self._spawn(name, command)
        return self._wait_ready(name)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every process this cluster started, newest first; SIGKILL stragglers."""
        for _, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, process in reversed(self.processes):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop; killing it", name, process.pid)
                process.kill()
                process.wait()
        self.processes.clear()
        for probe in self._health.values():
            probe.close()
        self._health.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def child_names(self) -> list[str]:
        """Every child's name, in start order: redis (when this cluster started it), workers, gateway."""
        return list(dict.fromkeys(name for name, _ in self.processes))

    def process(self, name: str) -> subprocess.Popen[bytes]:
        """The newest process started under ``name``."""
        return next(p for n, p in reversed(self.processes) if n == name)

    def kill(self, name: str) -> None:
        """SIGKILL one process (a crash, for failure tests)."""
        process = self.process(name)
        process.kill()
        process.wait()

    def respawn(self, name: str) -> None:
        """Start ``name`` again with its arguments, on the port it had; ``is_ready`` says when it serves."""
        self._ready_file(name).unlink(missing_ok=True)
        self._spawn(name, self._commands[name])

    def restart(self, name: str) -> str:
        """Stop ``name`` (SIGTERM, drained) and start it again on its port; returns its address once ready."""
        old = self.process(name)
        if old.poll() is None:
            old.send_signal(signal.SIGTERM)
            old.wait(timeout=15)
        self.respawn(name)
        return self._wait_ready(name)

    def location(self, name: str) -> str:
        """Where ``name`` serves: its host:port, or Redis's URL."""
        return (self.redis_url or "") if name == "redis" else self.addresses[name]

    def is_ready(self, name: str) -> bool:
        """Whether the newest ``name`` serves yet (its ready file was written; Redis: it accepts connections)."""
        if name == "redis":
            return self.redis_url is not None and redis_answers(self.redis_url)
        ready = self._ready_file(name)
        if not ready.exists():
            return False
        address, metrics_port = parse_ready(ready.read_text())
        self.addresses[name] = address
        # A restart binds the ports the first start got, so the gateway's --prefill/--decode stay true.
        command = self._commands[name]
        _set_option(command, "--port", address.rsplit(":", 1)[1])
        if metrics_port is not None and name in self.metrics_ports:
            self.metrics_ports[name] = metrics_port
            _set_option(command, "--metrics-port", str(metrics_port))
        return True

    def is_serving(self, name: str, timeout_s: float = 1.0) -> bool:
        """Health as a supervisor sees it: gRPC health SERVING within ``timeout_s``; Redis: accepts connections."""
        if name == "redis":
            return self.redis_url is not None and redis_answers(self.redis_url, timeout_s)
        if name not in self._health:
            self._health[name] = HealthProbe(self.addresses[name])
        return self._health[name].serving(timeout_s)

    def log_of(self, name: str) -> str:
        path = self._tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, name: str, lines: int = 15) -> str:
        return "\n".join(self.log_of(name).rstrip().splitlines()[-lines:])

    def worker_names(self) -> list[tuple[str, str]]:
        """(role, name) of every worker this cluster runs, in start order."""
        config = self.config
        roles = (
            (("colocated", config.colocated_workers),)
            if config.colocated_workers
            else (("prefill", config.prefill_workers), ("decode", config.decode_workers))
        )
        return [(role, f"{role}-{index}") for role, count in roles for index in range(count)]

    def _assign_metrics_ports(self, names: list[str]) -> None:
        base = self.config.metrics_port
        if base is None:
            return
        # Base 0: each process binds an ephemeral port itself and names it in its ready file (a port chosen
        # here and bound there could be taken in between); is_ready pins it, so a restart serves where it did.
        self.metrics_ports = {name: 0 if base == 0 else base + i for i, name in enumerate(names)}

    def _metrics_args(self, name: str) -> list[str]:
        return ["--metrics-port", str(self.metrics_ports[name])] if name in self.metrics_ports else []

    def _check_ports_free(self) -> None:
        """Fail before starting anything when a fixed port is taken: one line, naming the flag to change."""
        config = self.config
        wanted = [(config.port, "the gateway's gRPC port", "--port"),
                  (config.http_port, "the gateway's HTTP port", "--http-port")]
        if config.metrics_port:
            wanted += [(port, f"{name}'s metrics port", "--metrics-port") for name, port in self.metrics_ports.items()]
        for port, what, flag in wanted:
            if port and not port_free(config.host, port):
                raise StartupError(f"port {port} on {config.host} ({what}) is already in use: stop what holds it "
                                   f"or choose another with {flag}")

    def _ensure_redis(self) -> None:
        url = self.redis_url
        if url is None or redis_answers(url):
            return
        server = shutil.which("redis-server")
        parsed = urlparse(url)
        if server is None or parsed.hostname not in ("127.0.0.1", "localhost"):
            log.warning("no Redis answers at %s; serving without the prefix index (load-only routing)", url)
            self.redis_url = None
            return
        port = parsed.port or 6379
        self._spawn("redis", [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        deadline = time.monotonic() + 10
        while not redis_answers(url):
            process = self.process("redis")
            if process.poll() is not None or time.monotonic() > deadline:
                raise StartupError(f"redis-server did not start on port {port}: {_cause(self.log_of('redis'))}")
            time.sleep(0.05)

    def engines_share_cores(self) -> bool:
        """Whether more than one engine process of this cluster computes on this machine's cores: several
        workers, or one worker with tensor-parallel ranks (processes of their own)."""
        return len(self.worker_names()) > 1 or self._has_tensor_parallel_ranks()

    def engines_sleep_at_once(self) -> bool:
        """Whether its workers get ``OMP_WAIT_POLICY=PASSIVE``: engines share the cores and some of them do not
        turn their spin off themselves while the others compute (``--openmp-spin``, pdserve/shared_cores/openmp.py): a
        worker given ``--openmp-spin libgomp``, or tensor-parallel ranks (only a worker's own process has
        the governor)."""
        return self.engines_share_cores() and (self._has_tensor_parallel_ranks() or any(
            value == "libgomp" for args in self._worker_args() for value in _option_values(args, "--openmp-spin")))

    def _has_tensor_parallel_ranks(self) -> bool:
        return any(size > 1 for args in self._worker_args() for size in _tensor_parallel_sizes(args))

    def _worker_args(self) -> tuple[tuple[str, ...], ...]:
        """Every argument list some worker gets on top of the launcher's own."""
        config = self.config
        return config.engine_args, config.prefill_args, config.decode_args

    def _spawn(self, name: str, command: list[str]) -> None:
        # Where several engine processes share the machine's cores, OpenMP threads
        # that spin while they wait steal those cores from the other engine's busy
        # threads: any spin at all loses while both compute, while one engine
        # computing alone steps faster spinning (51-58 ms against 63-79 ms asleep;
        # both with benchmarks/cluster_throughput.py's burst, 2-vCPU Zen 5). Each worker's governor
        # (--openmp-spin adaptive, the default) switches its spin off while others
        # compute on its CPUs; processes without one sleep at once. A value the user set wins.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.config.extra_env}
        if self.engines_sleep_at_once():
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self._commands[name] = command
        argv = command if name == "redis" else [sys.executable, "-m", "pdserve", *command]
        log_file = open(self._tmp / f"{name}.log", "ab")  # noqa: SIM115 - kept open for the child's lifetime
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        log_file.close()
        self.processes.append((name, process))

    def _ready_file(self, name: str) -> Path:
        return self._tmp / f"{name}.ready"

    def _wait_ready(self, name: str) -> str:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not self.is_ready(name):
            process = self.process(name)
            if process.poll() is not None:
                raise StartupError(f"{name} exited with status {process.returncode} before serving: "
                                   f"{_cause(self.log_of(name))}")
            if time.monotonic() > deadline:
                raise StartupError(f"{name} did not become ready in {self.config.start_timeout_s:.0f} s; "
                                   f"its log ends with: {_cause(self.log_of(name))}")
            time.sleep(0.05)
        return self.addresses[name]


class HealthProbe:
    """A child's grpc.health.v1 status, asked over one channel kept open across its restarts."""

    def __init__(self, address: str) -> None:
        import grpc
        from grpc_health.v1 import health_pb2_grpc

        host, port = address.rsplit(":", 1)
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        # Reconnect quickly to a restarted child: grpc's default backoff grows to minutes.
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        self._channel = grpc.insecure_channel(f"{host}:{port}", options=options)
        self._stub = health_pb2_grpc.HealthStub(self._channel)

    def serving(self, timeout_s: float) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2

        try:
            reply = self._stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()


def _cause(log_text: str) -> str:
    """The line of a child's log that says why it stopped: its ``pdserve: error:`` line, else its last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("pdserve: error: "):
            return line.removeprefix("pdserve: error: ")
    return lines[-1] if lines else "(its log is empty)"


def parse_ready(text: str) -> tuple[str, int | None]:
    """A ready file's contents (``serve.write_ready``): the gRPC host:port, and the metrics port where the
    process serves metrics (a second line ``metrics PORT``)."""
    lines = text.strip().splitlines()
    metrics = [int(line.split()[1]) for line in lines[1:] if line.startswith("metrics ")]
    return lines[0].strip(), (metrics[0] if metrics else None)


def _set_option(command: list[str], flag: str, value: str) -> None:
    """Sets the value of ``flag``'s last ``--flag VALUE`` in ``command``: the one argparse keeps (an extra
    gateway's command repeats its first gateway's flags before its own)."""
    at = len(command) - 1 - command[::-1].index(flag)
    command[at + 1] = value


def _option_values(args: tuple[str, ...], flag: str) -> list[str]:
    """The values ``flag`` takes in ``args`` (either ``--flag VALUE`` or ``--flag=VALUE``)."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == flag]
    return values + [arg.removeprefix(flag + "=") for arg in args if arg.startswith(flag + "=")]


def _tensor_parallel_sizes(args: tuple[str, ...]) -> list[int]:
    """The values ``--tensor-parallel-size`` takes in ``args``."""
    return [int(value) for value in _option_values(args, "--tensor-parallel-size") if value.isdigit()]
