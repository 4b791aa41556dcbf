"""Attention over the paged KV cache, behind one interface with one backend per hardware path."""

from __future__ import annotations

from pdserve.engine.attention.backend import AttentionBackend, AttentionBatch
from pdserve.engine.attention.selector import select_backend

__all__ = ["AttentionBackend", "AttentionBatch", "select_backend"]
