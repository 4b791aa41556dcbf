"""Starts a whole cluster on this machine as processes: Redis (if needed), workers, gateway.

Every process binds loopback and an ephemeral port, and reports the port it got
through a ready file; the launcher waits for each, then starts the gateway with
the workers' addresses. ``stop()`` sends SIGTERM to every process it started
(by PID), waits, and kills what has not exited.
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
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

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
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "pdserve"
    kv_transport: str = "grpc"
    colocated_workers: int = 0  # > 0: workers doing prefill and decode, instead of separate roles
    routing: str = "prefix"  # or "round_robin"
    engine_args: tuple[str, ...] = ()  # passed to every worker (e.g. --num-kv-blocks 256)
    start_timeout_s: float = 300.0
    extra_env: dict[str, str] = field(default_factory=dict)


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
        self._args: dict[str, list[str]] = {}
        self.addresses: dict[str, str] = {}
        self._tmp = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.redis_url: str | None = config.redis_url
        self.prefill_addresses: list[str] = []
        self.decode_addresses: list[str] = []
        self.endpoint = ""

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
        """Start everything; returns the gateway's host:port."""
        config = self.config
        self._ensure_redis()
        redis_args = ["--redis-url", self.redis_url, "--redis-prefix", config.redis_prefix] if self.redis_url else []
        common = ["--host", config.host, "--port", "0", *redis_args, "--dtype", config.dtype, "--device", config.device]
        if config.model:
            common += ["--model", config.model]
        pending = []
        roles = (
            (("colocated", config.colocated_workers),)
            if config.colocated_workers
            else (("prefill", config.prefill_workers), ("decode", config.decode_workers))
        )
        for role, count in roles:
            for index in range(count):
                name = f"{role}-{index}"
                ready = self._tmp / f"{name}.ready"
                self._spawn(name, [role, *common, "--worker-id", name, "--ready-file", str(ready), *config.engine_args])
                pending.append((role, ready))
        for role, ready in pending:
            address = self._wait_ready(ready)
            self.addresses[ready.stem] = address
            if role in ("prefill", "colocated"):
                self.prefill_addresses.append(address)
            if role in ("decode", "colocated"):
                self.decode_addresses.append(address)
        gateway_ready = self._tmp / "gateway.ready"
        gateway_args = ["gateway", "--host", config.host, "--port", str(config.port), *redis_args,
                        "--kv-transport", config.kv_transport, "--routing", config.routing,
                        "--ready-file", str(gateway_ready)]
        if config.model:
            gateway_args += ["--model", config.model]
        if config.http_port is not None:
            gateway_args += ["--http-port", str(config.http_port)]
        if config.http_max_n is not None:
            gateway_args += ["--max-n", str(config.http_max_n)]
        for address in self.prefill_addresses:
            gateway_args += ["--prefill", address]
        for address in self.decode_addresses:
            gateway_args += ["--decode", address]
        self._spawn("gateway", gateway_args)
        self.endpoint = self._wait_ready(gateway_ready)
        return self.endpoint

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
        shutil.rmtree(self._tmp, ignore_errors=True)

    def process(self, name: str) -> subprocess.Popen[bytes]:
        """The newest process started under ``name``."""
        return next(p for n, p in reversed(self.processes) if n == name)

    def kill(self, name: str) -> None:
        """SIGKILL one process (a crash, for failure tests)."""
        process = self.process(name)
        process.kill()
        process.wait()

    def restart(self, name: str) -> str:
        """Start ``name`` again with its arguments, on the port it had; returns its address."""
        old = self.process(name)
        if old.poll() is None:
            old.send_signal(signal.SIGTERM)
            old.wait(timeout=15)
        args = list(self._args[name])
        port = self.addresses[name].rsplit(":", 1)[1]
        args[args.index("--port") + 1] = port
        ready = self._tmp / f"{name}.ready"
        ready.unlink(missing_ok=True)
        self._spawn(name, args)
        return self._wait_ready(ready)

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
        process = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(("redis", process))
        deadline = time.monotonic() + 10
        while not redis_answers(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)

    def _spawn(self, name: str, args: list[str]) -> None:
        # Every engine process of this cluster shares the machine's cores. OpenMP
        # threads that spin while they wait steal those cores from the other
        # engine's busy threads; sleeping at once lifted the cluster from 87% to
        # 93% of the in-process engine's throughput (BENCHMARKS.md). A value the
        # user set wins.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.config.extra_env}
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self._args[name] = args
        log_file = open(self._tmp / f"{name}.log", "ab")  # noqa: SIM115 - kept open for the child's lifetime
        process = subprocess.Popen([sys.executable, "-m", "pdserve", *args], stdout=log_file, stderr=subprocess.STDOUT, env=env)
        log_file.close()
        self.processes.append((name, process))

    def log_of(self, name: str) -> str:
        path = self._tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _wait_ready(self, ready: Path) -> str:
        deadline = time.monotonic() + self.config.start_timeout_s
        name = ready.stem
        while not ready.exists():
            process = self.process(name)
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode}:\n{self.log_of(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not become ready in {self.config.start_timeout_s:.0f} s")
            time.sleep(0.05)
        return ready.read_text().strip()
