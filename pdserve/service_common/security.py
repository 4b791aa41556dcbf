"""TLS, mutual TLS and bearer-token authentication for pdserve's servers and channels.

Servers take a ``TlsConfig`` (and a token) through ``ServerConfig``; every client
opens its channel with ``open_channel``, so one place decides plaintext or TLS.
The client side (``TlsConfig``, channels, call metadata) lives in the client
package, ``pdserve_client.channels``, and is re-exported here for the services.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from pdserve_client.channels import (
    CLIENT_FLAGS,
    TlsConfig,
    bearer_metadata,
    channel_credentials,
    open_blocking_channel,
    open_channel,
    os_error_reason,
    read_pem,
)

__all__ = [
    "CLIENT_FLAGS",
    "OPEN_METHOD_PREFIXES",
    "SERVER_FLAGS",
    "UNAUTHENTICATED_MESSAGE",
    "BearerTokenInterceptor",
    "TlsConfig",
    "bearer_metadata",
    "channel_credentials",
    "load_auth_token",
    "open_blocking_channel",
    "open_channel",
    "server_credentials",
    "server_ssl_context",
]

UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"
# Open without a token: load balancers and orchestrators probe health without
# credentials, and reflection only describes the API whose .proto files are public.
# Every other method, pdserve's own services included, needs the token.
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# The flag that sets each field on the server side, so an error names what the user typed.
SERVER_FLAGS = {"cert_file": "--tls-cert", "key_file": "--tls-key", "ca_file": "--tls-client-ca"}


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """The server side of ``tls``; a ValueError naming the flag when a file is missing or not PEM."""
    if tls.cert_file is None or tls.key_file is None:
        raise ValueError("a TLS server needs --tls-cert and --tls-key")
    key = read_pem(tls.key_file, SERVER_FLAGS["key_file"])
    chain = read_pem(tls.cert_file, SERVER_FLAGS["cert_file"])
    client_ca = read_pem(tls.ca_file, SERVER_FLAGS["ca_file"]) if tls.ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=tls.require_client_cert
    )


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """The same server side as ``server_credentials``, for a port served by Python's ``ssl`` (the OpenAI HTTP API).

    The certificate and key are the gRPC port's; with ``require_client_cert``
    a client without a certificate signed by the CA is refused here too.
    """
    if tls.cert_file is None or tls.key_file is None:
        raise ValueError("a TLS server needs --tls-cert and --tls-key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as error:
        raise ValueError(f"--tls-cert/--tls-key: cannot serve TLS with {tls.cert_file} and {tls.key_file}: {error}") from error
    if tls.ca_file is not None:
        try:
            context.load_verify_locations(cafile=tls.ca_file)
        except (OSError, ssl.SSLError) as error:
            raise ValueError(f"{SERVER_FLAGS['ca_file']}: cannot read {tls.ca_file}: {error}") from error
    if tls.require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def load_auth_token(token_file: str | None, env_value: str | None, env_name: str) -> str | None:
    """The bearer token from ``token_file`` (first) or an environment variable's value; None when neither is set.

    A file or a variable, not a flag, so the token never shows in ``ps``.
    """
    if token_file is not None:
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--auth-token-file {token_file}: cannot read it: {os_error_reason(error)}") from None
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


def _check_token(token: str, source: str) -> str:
    # What an HTTP/2 header value and RFC 6750's token syntax allow: visible ASCII, no spaces.
    if not token:
        raise ValueError(f"{source}: the bearer token is empty")
    if not all("!" <= char <= "~" for char in token):
        raise ValueError(f"{source}: the bearer token must be printable ASCII without spaces")
    return token


