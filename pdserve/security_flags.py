"""The command line's TLS and bearer-token flags, shared by every server role and client command.

grpc is imported only when a flag is read: ``pdserve --help`` and ``offline`` stay fast.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.service_common.security import TlsConfig

AUTH_TOKEN_ENV = "PDSERVE_AUTH_TOKEN"


def add_server_tls_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """TLS of the port a server listens on (default: plaintext)."""
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate (chain)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default=None, metavar="PEM",
                        help="mutual TLS: refuse clients without a certificate signed by this CA")


def add_client_tls_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, peers: str) -> None:
    """TLS of the connections this process opens to ``peers`` (default: plaintext)."""
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help=f"connect to {peers} over TLS; verify server certificates with this CA")
    parser.add_argument("--tls-client-cert", default=None, metavar="PEM",
                        help=f"present this certificate to {peers} (mutual TLS)")
    parser.add_argument("--tls-client-key", default=None, metavar="PEM", help="the private key of --tls-client-cert")
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="the name server certificates carry, when it is not the host in the address")


def add_auth_token_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, use: str) -> None:
    parser.add_argument("--auth-token-file", default=None, metavar="PATH",
                        help=f"{use} the bearer token in this file (default: ${AUTH_TOKEN_ENV}, if set)")


def server_tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The listening port's TLS, its files checked now (before a model loads); None: plaintext."""
    if args.tls_cert is None and args.tls_key is None and args.tls_client_ca is None:
        return None
    from pdserve.service_common.security import TlsConfig, server_credentials

    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca, require_client_cert=args.tls_client_ca is not None)
    server_credentials(tls)
    return tls


def client_tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """Outgoing connections' TLS, its files checked now; None (plaintext) unless a client TLS flag is given."""
    given = (args.tls_ca, args.tls_client_cert, args.tls_client_key, args.tls_server_name)
    if all(value is None for value in given):
        return None
    from pdserve.service_common.security import TlsConfig, channel_credentials

    if (args.tls_client_cert is None) != (args.tls_client_key is None):
        raise ValueError("a client certificate needs both --tls-client-cert and --tls-client-key")
    tls = TlsConfig(args.tls_client_cert, args.tls_client_key, args.tls_ca, server_name=args.tls_server_name)
    channel_credentials(tls)
    return tls


def auth_token_from_args(args: argparse.Namespace) -> str | None:
    """The token from --auth-token-file, else from $PDSERVE_AUTH_TOKEN; None when neither is set."""
    from pdserve.service_common.security import load_auth_token

    return load_auth_token(args.auth_token_file, os.environ.get(AUTH_TOKEN_ENV), AUTH_TOKEN_ENV)
