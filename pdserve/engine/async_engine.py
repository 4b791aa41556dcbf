"""The engine on its own thread, driven from asyncio through queues.

The engine is single-threaded and never awaits; the services are asyncio. This
bridge runs ``LLMEngine.step()`` in a loop on a dedicated thread, takes
commands (add, import, abort, a landed KV, any call) from a thread-safe queue between steps,
and hands each request's outputs back to its asyncio queue with
``call_soon_threadsafe``. A request's queue is attached by the command that adds
the request, on the engine thread, where every output is delivered: an id used
again at once (its earlier request aborted, the abort still queued) never gets
the earlier request's outputs. No gRPC or servers here: the services sit on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from pdserve.engine.batch_window import BatchWindow
from pdserve.engine.kv.block_manager import BlockEvent
from pdserve.engine.kv.handoff import KVFetch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.types.errors import EngineDeadError
from pdserve.engine.types.handoff import KVHandoff, KVHoldParams, KVSlot
from pdserve.engine.types.lora import LoRARequest
from pdserve.engine.types.outputs import EngineStats, RequestOutput
from pdserve.engine.types.sampling_params import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


# What a request's stream carries: its outputs, where its remote KV goes, or the error that ends it.
_StreamItem = RequestOutput | KVSlot | BaseException


@dataclass(eq=False)
class _Stream:
    """Where one request's outputs go: a queue read on ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_StreamItem] = field(default_factory=asyncio.Queue)
    detached: bool = False  # its reader went away: never attached again (under AsyncEngine._lock)


class AsyncEngine:
    """An ``LLMEngine`` stepping on a thread of its own, with an asyncio-facing API.

    ``generate`` and ``import_request`` yield cumulative ``RequestOutput``s until
    the request finishes; cancelling the consuming task aborts the request on
    the engine. ``on_block_events`` (if given) is called on the engine thread
    after every step that stored or evicted prefix blocks, ``before_work`` (if
    given) on the engine thread before every step and before queued commands run
    (``SpinGovernor.update``). ``batch_window``: the scheduling policy that may
    hold a step back for requests on their way (``engine.batch_window``); this
    bridge only waits as long as it says, running the commands that arrive.
    What a handoff holds that nobody claimed is dropped between steps
    (``LLMEngine.expire_unclaimed``).
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_block_events: Callable[[list[BlockEvent]], None] | None = None,
        idle_wait_s: float = 0.05,
        before_work: Callable[[], None] | None = None,
        batch_window: BatchWindow | None = None,
        run_load: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> None:
        """``run_load``: runs a blocking load off the engine thread (a LoRA adapter's read), called on a thread
        of asyncio's pool with the load; None runs it there. The worker runtime passes one that runs it on a
        thread of its own (pdserve/shared_cores/openmp.py: the load's OpenMP pool ends with it)."""
        self.engine = engine
        self._on_block_events = on_block_events
        self._before_work = before_work
        self._run_load = run_load
        self._idle_wait_s = idle_wait_s
        self.batch_window = batch_window or BatchWindow()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # Each request's stream, attached by the engine-thread command that added the request (``_attach``),
        # detached by its reader; both under ``_lock``. Outputs are delivered on the engine thread.
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        # Futures of ``call``s not answered yet. Once the thread is gone (``_closed``) no command
        # runs again: it fails them all, and a later ``call`` is refused, both under ``_lock``.
        self._pending: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = set()
        self._closed = False
        self._lock = threading.Lock()
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
        # The engine's other tensor-parallel ranks, if any, go with it.
        await asyncio.to_thread(self.engine.shutdown)

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

        entry = (loop, future)
        with self._lock:
            if self._closed:
                raise EngineDeadError(self._dead_reason() or "the engine stopped")
            self._pending.add(entry)
        self._commands.put(run)
        try:
            return await future
        finally:
            with self._lock:
                self._pending.discard(entry)

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
        hold_kv: KVHoldParams | None = None,
        validate_as: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        resume_token_ids: list[int] | tuple[int, ...] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes. Raises ``ValueError`` on bad input.

        ``validate_as``: check the request against these parameters rather than
        ``params`` (a prefill worker runs one token of a longer request).
        ``lora_request``: the LoRA adapter it runs under, read from its folder
        first (off the engine thread) when the engine does not hold it.
        ``resume_token_ids``: output generated elsewhere to continue after
        (``LLMEngine.add_request``); the first output is then the state at
        admission (those tokens and their text), before any step.
        """
        stream = _Stream(asyncio.get_running_loop())
        if lora_request is not None:
            await self.load_lora(lora_request)

        def add(engine: LLMEngine) -> None:
            # One command, so admission costs one trip to the engine thread, not two.
            self._check_id_free(request_id)
            if validate_as is not None:
                engine.validate_request(prompt, validate_as)
            engine.add_request(prompt, params, request_id, hold_kv=hold_kv, lora_request=lora_request,
                               resume_token_ids=resume_token_ids)
            self._attach(request_id, stream)
            if resume_token_ids:
                stream.loop.call_soon_threadsafe(_put_all, [(stream.queue, engine.state_of(request_id))])

        await self._start(request_id, stream, add)
        async with contextlib.aclosing(self._drain(request_id, stream)) as outputs:
            async for output in outputs:
                yield output

    async def import_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handoff: KVHandoff,
        receive_kv: Callable[[int], Awaitable[torch.Tensor | KVFetch | None]],
        pushed: bool = False,
        on_admitted: Callable[[int], None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Join a request prefilled elsewhere and yield its outputs.

        The request waits in the scheduler (WAITING_FOR_REMOTE_KVS) until it has
        blocks; then ``receive_kv(first_block)`` fetches the handoff's blocks from
        ``first_block`` on (None: they cannot be had, and the prompt is recomputed
        here), and they land between two steps. ``pushed``: its KV was pushed
        here, and it adopts the landed push's blocks (the engine's KV connector
        owns them until then; ``on_admitted`` hears how many blocks it adopted,
        once the request is in). When those and the prefix cache hold every
        block, ``receive_kv`` is not called: the request joins the batch as its
        blocks are allocated, one step sooner than a round trip through this
        event loop would (unless the engine's draft model takes the handoff's
        draft KV: ``receive_kv`` fetches that). The first output is the state at
        landing: the handed-off first token and its text.
        """
        stream = _Stream(asyncio.get_running_loop())
        if handoff.lora is not None:
            try:
                await self.load_lora(handoff.lora)
            except ValueError:
                await self.call(lambda engine: engine.kv_connector.drop_push(handoff.request_id,
                                                                             refuse_later=not pushed))
                raise

        def add(engine: LLMEngine) -> int:
            try:
                self._check_id_free(request_id)
            except ValueError:
                # Refused before the connector saw it: what was pushed for it goes, as the request would
                # have adopted or dropped it.
                engine.kv_connector.drop_push(handoff.request_id, refuse_later=not pushed)
                raise
            adopted = engine.kv_connector.scheduler.add_remote_request(
                request_id, prompt_token_ids, params, handoff, pushed)
            self._attach(request_id, stream)
            return adopted

        adopted = await self._start(request_id, stream, add)
        if on_admitted is not None:
            on_admitted(adopted)
        async with contextlib.aclosing(self._drain(request_id, stream, receive_kv)) as outputs:
            async for output in outputs:
                yield output

    async def load_lora(self, request: LoRARequest) -> None:
        """Have the engine hold ``request``'s LoRA adapter in host memory: read from its folder on a thread of its
        own while steps go on. ``ValueError`` naming the adapter when it cannot be served here."""
        if self.engine.lora is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: this worker serves no LoRA adapters "
                             "(start it with --enable-lora)")
        if await self.call(lambda engine: engine.lora.loaded(request) is not None):
            return
        manager = self.engine.lora
        read = functools.partial(manager.read, request)
        adapter = await asyncio.to_thread(self._run_load, read) if self._run_load else await asyncio.to_thread(read)
        await self.call(lambda engine: engine.lora.add_loaded(request, adapter))

    async def unload_lora(self, name: str) -> bool:
        """Forget LoRA adapter ``name`` (running requests under it finish); False when it was not loaded."""
        if self.engine.lora is None:
            return False
        return await self.call(lambda engine: engine.lora.unload(name))

    async def abort(self, request_id: str) -> None:
        if self.is_alive:
            await self.call(lambda engine: self._abort_on_thread(request_id))

    # ---- internals (asyncio side) -------------------------------------------------------

    async def _start(self, request_id: str, stream: _Stream, start: Callable[[LLMEngine], T]) -> T:
        """Run ``start`` (which adds the request and attaches ``stream``) on the engine thread and return what
        it returns; undo it if the caller goes away.

        A caller cancelled while the command waits behind a long step would
        otherwise leave a request nobody reads (or, with hold_kv, blocks held
        forever): the abort queued behind the command runs after it, FIFO. A
        rejected request (e.g. a duplicate id) was neither added nor attached,
        and is not aborted: that would hit the other request that owns the id.
        """
        started = False

        def run(engine: LLMEngine) -> T:
            nonlocal started
            result = start(engine)
            started = True
            return result

        try:
            return await self.call(run)
        except asyncio.CancelledError:
            self._detach(request_id, stream)
            self._commands.put(lambda: started and self._abort_on_thread(request_id))
            raise

    def _check_alive(self) -> None:
        reason = self._dead_reason()
        if reason is not None:
            raise EngineDeadError(reason)

    def _dead_reason(self) -> str | None:
        """Why no command runs any more (its thread failed, or is stopping); None while it serves."""
        if self.error is not None:
            return f"the engine stopped: {self.error!r}"
        if self._stopping.is_set():
            return "the engine is shutting down"
        return None

    def _detach(self, request_id: str, stream: _Stream) -> None:
        """``stream`` gets nothing more; a newer stream attached under ``request_id`` stays."""
        with self._lock:
            stream.detached = True
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]

    async def _drain(
        self,
        request_id: str,
        stream: _Stream,
        receive_kv: Callable[[int], Awaitable[torch.Tensor | KVFetch | None]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, KVSlot):
                    # Blocks are allocated: fetch the KV here, off the engine thread, then land it there.
                    assert receive_kv is not None, "only imported requests get KV slots"
                    blocks = await receive_kv(item.first_block)
                    self._commands.put(lambda slot=item, blocks=blocks: self._land_kv(slot, blocks))
                    continue
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._detach(request_id, stream)
            if not finished and self.is_alive:
                # Cancelled or failed mid-stream: free the request's blocks now.
                self._commands.put(lambda: self._abort_on_thread(request_id))

    # ---- internals (engine thread) ------------------------------------------------------

    def _check_id_free(self, request_id: str) -> None:
        """A stream still reading an earlier request of this id (it finished, its last output not read yet)
        keeps the id taken, as the engine does for a request it still has."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def _attach(self, request_id: str, stream: _Stream) -> None:
        """From now on ``request_id``'s outputs go to ``stream``. Called on the engine thread by the command that
        added the request, so no output of an earlier request of this id (aborted, its abort queued before this
        command) can reach it: every output is delivered on this thread too."""
        with self._lock:
            if not stream.detached:  # detached: its reader went away already, and its abort is queued behind this
                self._streams[request_id] = stream

    def _abort_on_thread(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def _land_kv(self, slot: KVSlot, blocks: torch.Tensor | KVFetch | None) -> None:
        connector = self.engine.kv_connector
        try:
            if blocks is None:
                output = connector.recompute(slot.request_id)
            else:
                output = connector.fill(slot.request_id, slot.first_block, blocks)
        except Exception as error:  # noqa: BLE001 - reported to that request only
            self._deliver(slot.request_id, error)
            return
        # None: aborted while its KV was on the way, and the KV is dropped.
        if output is not None:
            self._deliver(slot.request_id, output)

    def _deliver_kv_slots(self) -> None:
        """Requests that got their blocks: those whose KV is all there ran into the batch already (their first
        output goes out), the others' readers fetch what is missing."""
        slots, joined = self.engine.kv_connector.take_slots()
        for output in joined:
            self._deliver(output.request_id, output)
        for slot in slots:
            self._deliver(slot.request_id, slot)

    def _deliver(self, request_id: str, item: _StreamItem) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, in one wake-up of each event loop they go to: not one per request, as each
        ``call_soon_threadsafe`` writes the loop's self-pipe and a full batch would make that a write per sequence."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_StreamItem], RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _hold_before_step(self, busy: bool) -> None:
        """Wait as long as the batch window says (``engine.batch_window``), running the commands that
        arrive meanwhile: for a burst's next requests when the engine was idle, for the starts of
        pushed KV that landed."""
        window = self.batch_window
        if not window.enabled:
            return
        engine = self.engine
        if not busy:
            deadline = time.monotonic() + window.window_s
            self._wait_for_commands(lambda now: window.arrival_wait_s(engine, deadline, now))
        held_since = time.monotonic()
        self._wait_for_commands(lambda now: window.landing_wait_s(engine, busy, held_since, now))

    def _wait_for_commands(self, wait_s: Callable[[float], float]) -> None:
        """Run commands as they come while ``wait_s(now)`` is positive; stop at the first wait with none."""
        while (timeout_s := wait_s(time.monotonic())) > 0 and self._run_next_command(timeout_s):
            pass

    def _run_next_command(self, timeout_s: float) -> bool:
        """Run the next queued command, waiting up to ``timeout_s`` for it; False when none came."""
        try:
            command = self._commands.get(timeout=timeout_s)
        except queue.Empty:
            return False
        command()
        return True

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
                # Requests that only wait for remote KV leave the thread asleep: their KV lands as a command.
                busy = engine.has_work()
                commands = self._next_commands(0.0 if busy else self._idle_wait_s)
                if commands and self._before_work is not None:
                    # Commands compute too (a pushed layer's KV written here is an OpenMP region): a worker
                    # that writes pushed KV while it has nothing to step must not spin on the cores the
                    # prefill computes on.
                    self._before_work()
                for command in commands:
                    command()
                self._hold_before_step(busy)
                # What handoffs hold that nobody claimed in time (leases, pushed KV) goes back.
                engine.expire_unclaimed()
                # A tensor-parallel rank that died ends the engine now, not at the next request's step.
                engine.check_ranks()
                # Blocks allocated by a command: the transfer starts now, not after the next step.
                self._deliver_kv_slots()
                if engine.has_work():
                    if self._before_work is not None:
                        self._before_work()
                    step_started = time.monotonic()
                    outputs = engine.step()
                    self.batch_window.step_ran(time.monotonic() - step_started, len(outputs))
                    # Before the outputs reach anyone: a Load right after one must see this step.
                    self.latest_stats = engine.stats()
                    self._deliver_step(outputs)
                    self._deliver_kv_slots()
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
        finally:
            self._fail_pending_calls()

    def _fail_pending_calls(self) -> None:
        """The thread is gone: commands still queued never run, so their callers hear it now, not never."""
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, set()
        reason = self._dead_reason() or "the engine stopped"
        for loop, future in pending:
            with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody waits there
                loop.call_soon_threadsafe(_set_exception, future, EngineDeadError(reason))


def _put_all(items: list[tuple[asyncio.Queue[_StreamItem], RequestOutput]]) -> None:
    for stream, output in items:
        stream.put_nowait(output)


def _set_result(future: asyncio.Future[T], result: T) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
