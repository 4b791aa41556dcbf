"""The engine on its own thread, driven from asyncio through queues.

The engine is single-threaded and never awaits; the services are asyncio. This
bridge runs ``LLMEngine.step()`` in a loop on a dedicated thread, takes
commands (add, import, abort, any call) from a thread-safe queue between steps,
and hands each request's outputs back to its asyncio queue with
``call_soon_threadsafe``. No gRPC or servers here: the services sit on top.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.block_manager import BlockEvent
from engine.errors import EngineDeadError
from engine.llm_engine import EngineStats, KVExport, LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _PendingImport:
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    params: SamplingParams
    kv: KVExport


class AsyncEngine:
    """An ``LLMEngine`` stepping on a thread of its own, with an asyncio-facing API.

    ``generate`` and ``import_request`` yield cumulative ``RequestOutput``s until
    the request finishes; cancelling the consuming task aborts the request on
    the engine. ``on_block_events`` (if given) is called on the engine thread
    after every step that stored or evicted prefix blocks.
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_block_events: Callable[[list[BlockEvent]], None] | None = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        self.engine = engine
        self._on_block_events = on_block_events
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._pending_imports: list[_PendingImport] = []
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        # Written by the engine thread after every iteration (one reference
        # assignment), read by anyone: a consistent snapshot without a lock.
        self.latest_stats: EngineStats = engine.stats()

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        self._commands.put(lambda: None)  # wake the loop
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- the asyncio API ----------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, future, error)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(run)
        return await future

    def submit(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run ``fn(engine)`` on the engine thread between steps, without waiting for it.

        Nobody waits for the result, so a failure is logged, not raised into the
        engine loop (where it would stop the engine for every request).
        """
        self._check_alive()

        def run() -> None:
            try:
                fn(self.engine)
            except Exception:  # noqa: BLE001 - see above
                log.exception("a submitted engine command failed")

        self._commands.put(run)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        hold_kv: bool = False,
        validate_as: SamplingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes. Raises ``ValueError`` on bad input.

        ``validate_as``: check the request against these parameters rather than
        ``params`` (a prefill worker runs one token of a longer request).
        """
        stream = self._open_stream(request_id)

        def add(engine: LLMEngine) -> None:
            # One command, so admission costs one trip to the engine thread, not two.
            if validate_as is not None:
                engine.validate_request(prompt, validate_as)
            engine.add_request(prompt, params, request_id, hold_kv=hold_kv)

        await self._start(request_id, add)
        async for output in self._drain(request_id, stream):
            yield output

    async def import_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams, kv: KVExport
    ) -> AsyncIterator[RequestOutput]:
        """Join a request prefilled elsewhere (waiting for free blocks if need be) and yield its outputs.

        The first output is the state at import: the handed-off first token and its text.
        """
        stream = self._open_stream(request_id)
        pending = _PendingImport(request_id, prompt_token_ids, first_token_id, params, kv)
        await self._start(request_id, lambda engine: self._try_import(pending, queue_if_full=True))
        async for output in self._drain(request_id, stream):
            yield output

    async def resume_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """``LLMEngine.resume_request`` from asyncio; the first output is the state with the first token."""
        stream = self._open_stream(request_id)

        def resume(engine: LLMEngine) -> None:
            self._deliver(request_id, engine.resume_request(request_id, prompt_token_ids, first_token_id, params))

        await self._start(request_id, resume)
        async for output in self._drain(request_id, stream):
            yield output

    async def abort(self, request_id: str) -> None:
        if self.is_alive:
            await self.call(lambda engine: self._abort_on_thread(request_id))

    # ---- internals (asyncio side) -------------------------------------------------------

    async def _start(self, request_id: str, start: Callable[[LLMEngine], object]) -> None:
        """Run ``start`` (which adds the request) on the engine thread; undo it if the caller goes away.

        A caller cancelled while the command waits behind a long step would
        otherwise leave a request nobody reads (or, with hold_kv, blocks held
        forever): the abort queued behind the command runs after it, FIFO.
        """
        started = False

        def run(engine: LLMEngine) -> None:
            nonlocal started
            start(engine)
            started = True

        try:
            await self.call(run)
        except asyncio.CancelledError:
            self._streams.pop(request_id, None)
            self._commands.put(lambda: started and self._abort_on_thread(request_id))
            raise
        except BaseException:
            # Rejected (e.g. a duplicate id): nothing was added, and aborting
            # here would hit the other request that owns the id.
            self._streams.pop(request_id, None)
            raise

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        if self._stopping.is_set():
            raise EngineDeadError("the engine is shutting down")

    def _open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | BaseException]:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        return stream

    async def _drain(
        self, request_id: str, stream: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.is_alive:
                # Cancelled or failed mid-stream: free the request's blocks now.
                self._commands.put(lambda: self._abort_on_thread(request_id))

    # ---- internals (engine thread) ------------------------------------------------------

    def _abort_on_thread(self, request_id: str) -> None:
        self._pending_imports = [p for p in self._pending_imports if p.request_id != request_id]
        self.engine.abort_request(request_id)

    def _try_import(self, pending: _PendingImport, queue_if_full: bool) -> bool:
        output = self.engine.import_request(
            pending.request_id, pending.prompt_token_ids, pending.first_token_id, pending.params, pending.kv
        )
        if output is None:
            if queue_if_full:
                self._pending_imports.append(pending)
            return False
        # The state at import (first token, its text) opens the stream.
        self._deliver(pending.request_id, output)
        return True

    def _retry_pending_imports(self) -> None:
        still_waiting = []
        for index, pending in enumerate(self._pending_imports):
            try:
                imported = self._try_import(pending, queue_if_full=False)
            except Exception as error:  # noqa: BLE001 - reported to that request only
                self._deliver(pending.request_id, error)
                continue
            if not imported:
                # First come, first served: later imports wait behind this one.
                still_waiting.extend(self._pending_imports[index:])
                break
        self._pending_imports = still_waiting

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _next_commands(self, wait_s: float) -> list[Callable[[], None]]:
        """Every queued command, waiting up to ``wait_s`` for the first one."""
        commands = []
        try:
            commands.append(self._commands.get(timeout=wait_s) if wait_s > 0 else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                busy = engine.has_unfinished_requests()
                for command in self._next_commands(0.0 if busy else self._idle_wait_s):
                    command()
                if self._pending_imports:
                    self._retry_pending_imports()
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    # Before the outputs reach anyone: a Load right after one must see this step.
                    self.latest_stats = engine.stats()
                    for output in outputs:
                        self._deliver(output.request_id, output)
                    if self._on_block_events is not None:
                        events = engine.drain_block_events()
                        if events:
                            self._on_block_events(events)
                self.latest_stats = engine.stats()
        except BaseException as error:  # noqa: BLE001 - every waiter must hear about it
            log.exception("engine thread failed")
            self.error = error
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine stopped: {error!r}"))


def _set_result(future: asyncio.Future[T], result: T) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
