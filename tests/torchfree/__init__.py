"""The gateway and the client without torch: import hygiene, a torch-free gateway process, the client package."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from prefill_service.server import PrefillServer
from service_common.server import ServerConfig
from service_common.worker import WorkerConfig


def _engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(checkpoint), dtype="float32"),
                                  cache=CacheConfig(num_kv_blocks=64)))


@asynccontextmanager
async def workers(checkpoint: Path) -> AsyncIterator[tuple[str, str]]:
    """A prefill and a decode worker in this process (loopback, no Redis); yields their addresses.

    The gateway under test runs elsewhere: in another process, or started by the test.
    """
    prefill = PrefillServer(_engine(checkpoint), ServerConfig(), WorkerConfig("prefill", "p0"))
    decode = DecodeServer(_engine(checkpoint), ServerConfig(), WorkerConfig("decode", "d0"))
    started: list[PrefillServer | DecodeServer] = []
    try:
        p_port = await prefill.start()
        started.append(prefill)
        d_port = await decode.start()
        started.append(decode)
        yield f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}"
    finally:
        for server in reversed(started):
            await server.stop()
