"""A TCP relay in front of the real Redis that a test can take down and bring back on the same port."""

from __future__ import annotations

import asyncio
import contextlib


class RedisProxy:
    """Relays 127.0.0.1:<port> to the real Redis; ``stop()`` drops every connection like a crashed server."""

    def __init__(self, target_host: str = "127.0.0.1", target_port: int = 6379) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.BaseTransport] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def is_running(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        # Port 0 the first time; the same port afterwards, so clients reconnect to it.
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for transport in list(self._transports):
            transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        self._transports.update({client_writer.transport, upstream_writer.transport})
        relays = [
            asyncio.create_task(_relay(client_reader, upstream_writer)),
            asyncio.create_task(_relay(upstream_reader, client_writer)),
        ]
        self._tasks.update(relays)
        try:
            await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for relay in relays:
                relay.cancel()
            for writer in (client_writer, upstream_writer):
                writer.transport.abort()
                self._transports.discard(writer.transport)
            self._tasks.difference_update(relays)


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
