"""Reliability tests: bad and random requests against an in-process cluster.

``InProcessCluster`` moved to ``tests.support.cluster``; these names stay importable from here
for tests written before the move.
"""

from __future__ import annotations

from tests.support.cluster import CLIENT_OPTIONS, NUM_KV_BLOCKS, InProcessCluster

__all__ = ["CLIENT_OPTIONS", "NUM_KV_BLOCKS", "InProcessCluster"]
