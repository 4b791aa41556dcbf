"""Errors that cross from the engine to the services; pure Python, so the gateway and the
error mapping in ``service_common`` can name them without loading torch or the model code."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can progress."""
