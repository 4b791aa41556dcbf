"""The OpenAI HTTP API of an in-process cluster (tests/support/cluster.py) with the official openai client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai

from pdserve.gateway.tokenizer import load_tokenizer
from tests.support.cluster import ClusterOptions, InProcessCluster


@asynccontextmanager
async def served(checkpoint: Path, colocated: bool = False, **gateway_args: Any
                 ) -> AsyncIterator[tuple[InProcessCluster, openai.AsyncOpenAI]]:
    """1 prefill and 1 decode worker (or one colocated worker) and a gateway with ``gateway_args``, serving HTTP with
    ``checkpoint``'s tokenizer; the cluster and a client of its HTTP API. Every worker is idle again on exit."""
    roles: dict[str, Any] = dict(prefill_workers=0, decode_workers=0, colocated_workers=1) if colocated else {}
    options = ClusterOptions(num_kv_blocks=128, http=True, tokenizer=load_tokenizer(str(checkpoint)),
                             gateway_args=gateway_args, **roles)
    async with InProcessCluster(checkpoint, options) as cluster:
        assert cluster.gateway is not None
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.gateway.http_port}/v1", api_key="unused",
                                      max_retries=0) as client:
            yield cluster, client
        await cluster.wait_idle()
