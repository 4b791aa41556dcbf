"""Building and running a grpc.aio server the way every pdserve process does."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve_client.channels import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from pdserve.service_common.errors import Unparsable
from pdserve.service_common.security import BearerTokenInterceptor, TlsConfig, server_credentials

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "LIVENESS_SERVICE", "LOOPBACK_HOSTS", "Server", "ServerConfig", "channel_options",
           "install_uvloop", "port_free", "run_until_signal"]

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
# The health service name a liveness probe asks for: SERVING until the process can no longer
# serve (its engine died), and still SERVING while it drains, when "" (readiness) is NOT_SERVING,
# so an orchestrator stops sending work without killing a process that finishes its streams.
LIVENESS_SERVICE = "liveness"


# The gateway pings a worker this often during its calls, and drops the connection when a ping goes unanswered this
# long: a partitioned or frozen worker's streams fail UNAVAILABLE (and move) within about twice this.
WORKER_KEEPALIVE_MS = 5000


@dataclass(frozen=True)
class ServerConfig:
    """Where a server listens, how large a message it accepts, and who may call it."""

    host: str = "127.0.0.1"  # loopback unless configured otherwise
    port: int = 0  # 0: an ephemeral port
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 5.0
    tls: TlsConfig | None = None  # None: plaintext
    # None: no authentication. Out of repr so the token never reaches a log line.
    auth_token: str | None = field(default=None, repr=False)
    # A second, plaintext port that serves the health service alone (None: none): Kubernetes'
    # gRPC probes cannot speak TLS, and health says nothing a caller needs a token for.
    health_port: int | None = None

    @property
    def options(self) -> list[tuple[str, int]]:
        # Callers ping during their calls (the gateway every WORKER_KEEPALIVE_MS, to see a partitioned worker):
        # pings that often are welcome even while a stream sends no data, not answered with a GOAWAY.
        return [*channel_options(self.max_message_bytes),
                ("grpc.http2.min_ping_interval_without_data_ms", WORKER_KEEPALIVE_MS // 2),
                ("grpc.http2.max_ping_strikes", 0)]


def install_uvloop() -> bool:
    """Use uvloop's event loop policy when it is installed."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (a port in TIME_WAIT counts as free, as it does for servers)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


class Server:
    """A grpc.aio server with health and reflection, bound to one port."""

    def __init__(self, config: ServerConfig, service_names: Sequence[str]) -> None:
        self.config = config
        # Built now, so a missing certificate fails construction rather than the bind.
        self._credentials = server_credentials(config.tls) if config.tls is not None else None
        interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token is not None else None
        if config.auth_token is not None and config.tls is None and config.host not in LOOPBACK_HOSTS:
            log.warning("bearer auth without TLS on %s: tokens cross the network in clear text", config.host)
        # Without SO_REUSEPORT a second server on a taken port fails to bind instead of silently
        # sharing the port (and its traffic) with the first; grpc turns it on by default.
        self.grpc_server = grpc.aio.server(options=[*config.options, ("grpc.so_reuseport", 0)], interceptors=interceptors)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.grpc_server)
        self._service_names = list(service_names)
        self.port = 0
        self.health_port = 0
        self._health_server: grpc.aio.Server | None = None
        if config.health_port is not None:
            self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)

    def add_servicer(self, add_to_server: Callable[[Any, Any], None], servicer: Any) -> None:
        """Register a servicer through its generated ``add_*_to_server``, with lenient request parsing.

        A request that does not parse reaches the handler as ``Unparsable``
        (answered INVALID_ARGUMENT by ``grpc_errors``) instead of ending as UNKNOWN.
        """
        capture = _HandlerCapture()
        add_to_server(servicer, capture)
        for service, handlers in capture.services:
            lenient = {
                name: handler._replace(request_deserializer=_lenient(handler.request_deserializer))
                for name, handler in handlers.items()
            }
            self.grpc_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, lenient),))
            self.grpc_server.add_registered_method_handlers(service, lenient)

    async def start(self) -> int:
        address = f"{self.config.host}:{self.config.port}"
        # Asked first, so a taken port gets our one-line error instead of grpc's log line and
        # reasonless "Failed to bind"; grpc's own failure below still covers a race.
        if self.config.port and not port_free(self.config.host, self.config.port):
            raise OSError(f"could not serve on {address}: the port is in use; stop what holds it or choose another "
                          "with --port")
        if self._credentials is None:
            try:
                self.port = self.grpc_server.add_insecure_port(address)
            except RuntimeError as error:  # grpc's "Failed to bind", with no reason
                raise OSError(f"could not serve on {address}: the port is in use (or {self.config.host} is not "
                              f"an address of this machine); stop what holds it or choose another with --port") from error
        else:
            try:
                self.port = self.grpc_server.add_secure_port(address, self._credentials)
            except RuntimeError as error:
                # grpc says only "failed to bind"; a key that is not the certificate's is the usual cause.
                raise OSError(f"could not serve TLS on {address}: is the port free, and is --tls-key "
                              f"the key of --tls-cert? ({error})") from error
        if self.port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        if self._health_server is not None:
            self.health_port = self._bind_health_port()
        await self.grpc_server.start()
        if self._health_server is not None:
            await self._health_server.start()
        await self.set_serving(True)
        return self.port

    def _bind_health_port(self) -> int:
        assert self._health_server is not None and self.config.health_port is not None
        address = f"{self.config.host}:{self.config.health_port}"
        if self.config.health_port and not port_free(self.config.host, self.config.health_port):
            raise OSError(f"could not serve health on {address}: the port is in use; choose another with --health-port")
        try:
            port = self._health_server.add_insecure_port(address)
        except RuntimeError as error:
            raise OSError(f"could not serve health on {address}: the port is in use; choose another "
                          "with --health-port") from error
        if port == 0:
            raise OSError(f"could not bind {address} (--health-port)")
        return port

    async def set_serving(self, serving: bool) -> None:
        """Readiness and liveness both: SERVING once started, NOT_SERVING once this process cannot serve."""
        await self._set_status(["", *self._service_names, LIVENESS_SERVICE], serving)

    async def _set_status(self, names: Sequence[str], serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in names:
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, let running ones finish within the grace period (``grace_s``, default
        the configured one), then stop.

        While it drains, readiness ("" and the service names) is NOT_SERVING and liveness
        stays as it was; the health port answers until the drain is over.
        """
        await self._set_status(["", *self._service_names], False)
        await self.grpc_server.stop(self.config.grace_s if grace_s is None else grace_s)
        if self._health_server is not None:
            await self._health_server.stop(None)


class _HandlerCapture:
    """Quacks like a server for a generated ``add_*_to_server``: records the method handlers."""

    def __init__(self) -> None:
        self.services: list[tuple[str, dict[str, Any]]] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers arrive through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.services.append((service, handlers))


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # noqa: BLE001 - DecodeError and friends, answered by the handler
            return Unparsable(error)

    return parse


async def run_until_signal(stop: Callable[[], Awaitable[None]], failed: asyncio.Event | None = None) -> bool:
    """Wait for SIGINT or SIGTERM (or ``failed`` to be set), then run ``stop``; True when a signal came."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    waits = [asyncio.ensure_future(stopped.wait())]
    if failed is not None:
        waits.append(asyncio.ensure_future(failed.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    log.info("shutting down")
    await stop()
    return stopped.is_set()
