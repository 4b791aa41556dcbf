"""Clients of pdserve's public API: the client package, ``pdserve_client``, under pdserve's own name.

``AsyncClient``, ``Client``, ``SamplingOptions`` and the typed results are
defined there once (it installs on its own, with grpcio and protobuf only).
"""

from __future__ import annotations

from pdserve_client import *  # noqa: F403
from pdserve_client import __all__  # noqa: F401
