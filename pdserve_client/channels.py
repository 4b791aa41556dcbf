"""Opening a gRPC channel to pdserve: plaintext or TLS (mutual TLS with a client certificate),
message-size limits, and the bearer token's call metadata.

The servers use the same ``TlsConfig`` and limits (``service_common`` imports them
from here), so one place decides how every pdserve connection is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

# Internal messages carry KV chunks of at most 1 MiB plus framing; public ones
# carry prompts. Both limits are explicit so a bad peer cannot make us buffer more.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024

# The flag that sets each field on the client side, so an error names what the user typed.
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


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """The client side of ``tls``; a ValueError naming the flag when a file is missing or not PEM."""
    roots = read_pem(tls.ca_file, CLIENT_FLAGS["ca_file"]) if tls.ca_file is not None else None
    key = read_pem(tls.key_file, CLIENT_FLAGS["key_file"]) if tls.key_file is not None else None
    chain = read_pem(tls.cert_file, CLIENT_FLAGS["cert_file"]) if tls.cert_file is not None else None
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


def read_pem(path: str, flag: str) -> bytes:
    """The PEM file at ``path``; a ValueError naming ``flag`` (the option that gave it) when it is unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read it: {os_error_reason(error)}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def os_error_reason(error: Exception) -> str:
    """``error``'s reason without the errno and path that the caller's message already names."""
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)
