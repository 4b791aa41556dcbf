"""pdserve's Python client: the public gRPC API (``pdserve.v1.Generation``) with typed results.

Installs on its own with grpcio and protobuf only (``pip install ./client``);
inside pdserve it is also ``pdserve.client``.
"""

from __future__ import annotations

from pdserve_client.channels import TlsConfig
from pdserve_client.client import (
    DEFAULT_TARGET,
    AsyncClient,
    Client,
    Completion,
    ModelInfo,
    PdserveError,
    SamplingOptions,
    StreamChunk,
    TokenLogprob,
    Usage,
)

__all__ = [
    "DEFAULT_TARGET",
    "AsyncClient",
    "Client",
    "Completion",
    "ModelInfo",
    "PdserveError",
    "SamplingOptions",
    "StreamChunk",
    "TlsConfig",
    "TokenLogprob",
    "Usage",
]
