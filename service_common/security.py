"""TLS, mutual TLS and bearer-token authentication for pdserve's servers and channels.

Servers take a ``TlsConfig`` (and a token) through ``ServerConfig``; every client
opens its channel with ``open_channel``, so one place decides plaintext or TLS.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"
# Open without a token: load balancers and orchestrators probe health without
# credentials, and reflection only describes the API whose .proto files are public.
# Every other method, pdserve's own services included, needs the token.
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# The flag that sets each field, per side, so an error names what the user typed.
SERVER_FLAGS = {"cert_file": "--tls-cert", "key_file": "--tls-key", "ca_file": "--tls-client-ca"}
CLIENT_FLAGS = {"cert_file": "--tls-client-cert", "key_file": "--tls-client-key", "ca_file": "--tls-ca"}


@dataclass(frozen=True)
class TlsConfig:
    """PEM files of one side of a TLS connection; paths only, read when credentials are built.

    For a server: ``cert_file``/``key_file`` are its certificate (chain) and key;
    ``ca_file`` is the CA that client certificates must chain to, and with
    ``require_client_cert`` a client without such a certificate is refused (mTLS).
    For a client: ``ca_file`` is the CA that verifies servers (None: the system's
    roots); ``cert_file``/``key_file`` are an optional client certificate for mTLS;
    ``server_name`` is the name servers' certificates are checked against instead of
    the host in the address (workers are often reached by IP).
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    require_client_cert: bool = False
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a TLS certificate and its key go together: give both the certificate and the key file")
        if self.require_client_cert and self.ca_file is None:
            raise ValueError("requiring client certificates needs the CA that signs them (--tls-client-ca)")


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """The server side of ``tls``; a ValueError naming the flag when a file is missing or not PEM."""
    if tls.cert_file is None or tls.key_file is None:
        raise ValueError("a TLS server needs --tls-cert and --tls-key")
    key = _read_pem(tls.key_file, SERVER_FLAGS["key_file"])
    chain = _read_pem(tls.cert_file, SERVER_FLAGS["cert_file"])
    client_ca = _read_pem(tls.ca_file, SERVER_FLAGS["ca_file"]) if tls.ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=tls.require_client_cert
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """The client side of ``tls``; a ValueError naming the flag when a file is missing or not PEM."""
    roots = _read_pem(tls.ca_file, CLIENT_FLAGS["ca_file"]) if tls.ca_file is not None else None
    key = _read_pem(tls.key_file, CLIENT_FLAGS["key_file"]) if tls.key_file is not None else None
    chain = _read_pem(tls.cert_file, CLIENT_FLAGS["cert_file"]) if tls.cert_file is not None else None
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)


def open_channel(
    address: str,
    tls: TlsConfig | None,
    options: Sequence[tuple[str, Any]] = (),
    *,
    server_name_override: str | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: plaintext when ``tls`` is None, else TLS (mTLS with a client certificate).

    ``server_name_override`` (default ``tls.server_name``) is the name the server's
    certificate must carry when it differs from the host in ``address``.
    """
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(
        address, channel_credentials(tls), options=_tls_options(tls, options, server_name_override)
    )


def open_blocking_channel(
    address: str,
    tls: TlsConfig | None,
    options: Sequence[tuple[str, Any]] = (),
    *,
    server_name_override: str | None = None,
) -> grpc.Channel:
    """``open_channel`` for grpc's blocking API (the synchronous client)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(tls), options=_tls_options(tls, options, server_name_override))


def _tls_options(
    tls: TlsConfig, options: Sequence[tuple[str, Any]], server_name_override: str | None
) -> list[tuple[str, Any]]:
    server_name = server_name_override or tls.server_name
    return [*options, ("grpc.ssl_target_name_override", server_name)] if server_name else list(options)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (none when it is None), for a server with bearer auth."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def load_auth_token(token_file: str | None, env_value: str | None, env_name: str) -> str | None:
    """The bearer token from ``token_file`` (first) or an environment variable's value; None when neither is set.

    A file or a variable, not a flag, so the token never shows in ``ps``.
    """
    if token_file is not None:
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--auth-token-file {token_file}: cannot read it: {_reason(error)}") from None
        return _check_token(text.strip(), f"--auth-token-file {token_file}")
    if env_value:
        return _check_token(env_value.strip(), env_name)
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` with UNAUTHENTICATED.

    Health and reflection stay open (``OPEN_METHOD_PREFIXES``). A refused call
    never reaches its servicer, and its request is never parsed.
    """

    def __init__(self, token: str, open_method_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        self._token = _check_token(token, "the bearer token").encode()
        self._open_method_prefixes = open_method_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open_method_prefixes):
            return handler  # an unknown method is answered UNIMPLEMENTED either way
        if self._authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _refusal(handler)

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]]) -> bool:
        value = next((value for key, value in metadata if key == "authorization"), None)
        if not isinstance(value, str):
            return False
        scheme, _, token = value.partition(" ")
        # compare_digest: the time taken does not tell how much of a guess was right.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._token)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind (unary or streaming each way) that aborts with UNAUTHENTICATED.

    No deserializer: the request stays unparsed bytes, never read.
    """

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def _read_pem(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read it: {_reason(error)}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def _check_token(token: str, source: str) -> str:
    # What an HTTP/2 header value and RFC 6750's token syntax allow: visible ASCII, no spaces.
    if not token:
        raise ValueError(f"{source}: the bearer token is empty")
    if not all("!" <= char <= "~" for char in token):
        raise ValueError(f"{source}: the bearer token must be printable ASCII without spaces")
    return token


def _reason(error: Exception) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)
