"""Rank 0's handle on ranks 1..N-1 of a tensor-parallel engine, and the loop those ranks run.

Rank 0 (the engine process) starts the other ranks (``torch.multiprocessing``,
forkserver) as soon as it knows the model; they load their shards while rank 0
loads its own. ``connect`` then waits for every rank to report ready (or the
error it failed with), joins the group and tells them the pool size rank 0
chose, so that block ids mean the same on every rank.

A follower rank only executes: it waits for rank 0's next command (a header
broadcast), runs it and waits again. It exits when told to, when a collective
fails (rank 0 or another rank died: the socket closes) or when its parent is
gone (a watchdog thread), so nothing outlives the engine. Rank 0 checks that
its ranks are alive before every command; a dead rank makes the engine fail
with ``TensorParallelError`` (the service reports NOT_SERVING and the
supervisor restarts the whole worker).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.connection
import os
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.engine.attention.selector import select_backend
from pdserve.engine.kv.cache import KVCache
from pdserve.engine.kv.pages import PageLayout, PageMirror
from pdserve.engine.model_loader import load_hf_config, load_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.group import TensorParallelError, TensorParallelGroup
from pdserve.engine.parallel.kv_shards import follower_export, follower_import
from pdserve.engine.parallel.sharding import TensorParallelShard, install_all_reduce, kv_heads_of_rank
from pdserve.engine.parallel.step_codec import HEADER_LEN, Command, StepInputs, decode_step, encode_step
from pdserve.engine.parallel.vocab_head import gather_split_logits, install_split_head, send_split_logits
from pdserve.engine.types.config import EngineConfig

logger = logging.getLogger(__name__)
# A follower's exit status when a collective failed under it (another rank died or timed out).
COLLECTIVE_FAILED_EXIT = 4

# How long rank 0 waits for every rank to load its shard and report ready.
STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankSpec:
    """What a follower rank builds its shard from (pickled once, at spawn)."""

    config: EngineConfig
    model_path: str
    dtype: torch.dtype
    device: str  # rank 0's device; CUDA rank r uses the device index after it
    kv_cache_dtype: torch.dtype
    max_model_len: int
    world_size: int
    store_port: int
    backend: str  # gloo or nccl
    num_threads: int  # torch threads of a follower rank


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the same CPU, or the ``rank``-th CUDA device after rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TensorParallelWorkers:
    """Ranks 1..N-1 as seen from rank 0: started at construction, joined by ``connect``."""

    def __init__(self, config: EngineConfig, model_path: str, dtype: torch.dtype, device: torch.device,
                 kv_cache_dtype: torch.dtype, max_model_len: int) -> None:
        parallel = config.parallel
        self.world_size = parallel.tensor_parallel_size
        self.timeout_s = parallel.collective_timeout_s
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and (device.index or 0) + self.world_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={self.world_size} needs {self.world_size} CUDA devices from {device}, "
                f"this machine has {torch.cuda.device_count()}"
            )
        self.lock = threading.RLock()
        self.group: TensorParallelGroup | None = None
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=max(self.timeout_s, STARTUP_TIMEOUT_S)),
        )
        spec = RankSpec(
            config=config, model_path=model_path, dtype=dtype, device=str(device), kv_cache_dtype=kv_cache_dtype,
            max_model_len=max_model_len, world_size=self.world_size, store_port=self._store.port,
            backend=self.backend, num_threads=max(1, (os.cpu_count() or 1) // self.world_size),
        )
        context = _process_context()
        self._processes: list[Any] = []
        self._pipes: list[multiprocessing.connection.Connection] = []
        try:
            for rank in range(1, self.world_size):
                parent_end, child_end = context.Pipe(duplex=True)
                process = context.Process(
                    target=_follower_main, args=(rank, spec, child_end),
                    name=f"pdserve-tp-rank{rank}", daemon=True,
                )
                process.start()
                child_end.close()
                self._processes.append(process)
                self._pipes.append(parent_end)
        except BaseException:
            self.shutdown()
            raise
        # An engine dropped without shutdown() still stops its ranks.
        weakref.finalize(self, _terminate, list(self._processes))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def connect(self, num_blocks: int, paged: bool = False) -> TensorParallelGroup:
        """Wait until every rank loaded its shard, join the group, and give them the pool size and whether its
        sliding-window layers' blocks are paged (engine.kv.pages)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (process, pipe) in enumerate(zip(self._processes, self._pipes), start=1):
            while not pipe.poll(0.1):
                if not process.is_alive():
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited (code {process.exitcode}) while loading")
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {rank} did not load within {STARTUP_TIMEOUT_S} s")
            try:
                status, message = pipe.recv()
            except EOFError:
                raise TensorParallelError(f"tensor-parallel rank {rank} exited while loading") from None
            if status != "ready":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {message}")
        self.group = TensorParallelGroup(self._store, 0, self.world_size, self.backend, self.timeout_s, self.device)
        self.group.broadcast(torch.tensor([num_blocks, int(paged)], dtype=torch.long))
        return self.group

    @property
    def comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def install(self, model: torch.nn.Module) -> None:
        """Rank 0's row-parallel projections all-reduce over the group; its LM head's parts are joined."""
        assert self.group is not None
        group = self.group

        def all_reduce(tensor: torch.Tensor) -> None:
            with self._diagnosed():
                group.all_reduce(tensor)

        install_all_reduce(model, all_reduce)
        install_split_head(model)

    def gather_logits(self, model: torch.nn.Module, hidden_rows: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden_rows`` (rows, hidden) over the whole vocabulary, each rank computing its
        part; right after a step broadcast with these rows as its ``logits_rows`` (``lock`` held)."""
        assert self.group is not None
        with self._diagnosed():
            return model.cap_logits(gather_split_logits(model.lm_head_packed, hidden_rows, self.group, self.comm_device))

    @contextlib.contextmanager
    def _diagnosed(self) -> Iterator[None]:
        """A failed collective names the rank that died, when one did (gloo reports a reset socket first)."""
        try:
            yield
        except TensorParallelError as exc:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                dead = self._dead_ranks()
                if dead:
                    raise TensorParallelError(f"{dead}: {exc}") from exc
                time.sleep(0.05)
            raise

    def check_alive(self) -> None:
        if self.group is None:
            raise TensorParallelError("the tensor-parallel ranks were shut down (or never joined)")
        dead = self._dead_ranks()
        if dead:
            raise TensorParallelError(dead)

    def _dead_ranks(self) -> str:
        """Which ranks died ("" when none): first those that died on their own, then those that exited
        because a collective with them failed (``COLLECTIVE_FAILED_EXIT``)."""
        dead = [(rank, p.exitcode) for rank, p in enumerate(self._processes, start=1) if not p.is_alive()]
        dead.sort(key=lambda item: item[1] == COLLECTIVE_FAILED_EXIT)
        return "; ".join(f"tensor-parallel rank {rank} died (exit code {code})" for rank, code in dead)

    def command(self, header: list[int]) -> None:
        """Broadcast a command header; call with ``lock`` held."""
        self.check_alive()
        assert self.group is not None
        with self._diagnosed():
            self.group.broadcast(torch.tensor(header + [0] * (HEADER_LEN - len(header)), dtype=torch.long))

    def broadcast_step(self, inputs: StepInputs) -> None:
        """Tell every rank to run ``inputs`` (call with ``lock`` held, then run the step here too)."""
        self.check_alive()
        assert self.group is not None
        header, payload = encode_step(inputs)
        with self._diagnosed():
            self.group.broadcast(header)
            self.group.broadcast(payload)

    def shutdown(self) -> None:
        """Stop every rank (a command when the group is up, then join; terminate what does not exit)."""
        if self.group is not None:
            try:
                with self.lock:
                    if all(p.is_alive() for p in self._processes):
                        self.command([Command.SHUTDOWN])
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.warning("tensor-parallel shutdown command failed", exc_info=True)
            self.group = None
        for process in self._processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self._pipes:
            pipe.close()  # a rank still running sees EOF and exits
        self._processes, self._pipes = [], []


# What every rank imports anyway (transformers' config classes: AutoConfig imports them lazily, seconds each).
_PRELOAD = [
    "torch", "pdserve.engine.parallel.workers", "pdserve.engine.model_runner", "pdserve.engine.model_loader",
    "transformers.models.auto.configuration_auto", "transformers.models.llama.configuration_llama",
    "transformers.models.qwen2.configuration_qwen2",
]


def _process_context() -> Any:
    """forkserver, its server preloaded with torch and this module: the first engine pays for starting
    it once (a few seconds of imports), later ones fork ranks from it in milliseconds. Never a plain
    fork of the engine process, whose OpenMP and gRPC threads do not survive a fork."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _terminate(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()


# ---- the follower ranks ------------------------------------------------------------------


def _watch_parent(pipe: multiprocessing.connection.Connection) -> None:
    """Exit when rank 0 closes its end of the pipe or dies (EOF), so a killed engine leaves no ranks behind.

    Not ``os.getppid()``: a rank's parent is the forkserver, not the engine."""
    try:
        while True:
            pipe.recv()
    except (EOFError, OSError):
        os._exit(3)


def _follower_main(rank: int, spec: RankSpec, pipe: multiprocessing.connection.Connection) -> None:
    # Watching from the start: a rank 0 that dies while this rank loads or joins the group
    # (whose rendezvous has no bound) must not leave it waiting forever.
    threading.Thread(target=_watch_parent, args=(pipe,), name="tp-parent-watchdog", daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    try:
        follower = _Follower(rank, spec)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        pipe.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    pipe.send(("ready", ""))
    try:
        follower.run()
    except TensorParallelError as exc:
        logger.error("%s", exc)
        os._exit(COLLECTIVE_FAILED_EXIT)


class _Follower:
    """One rank other than 0: its shard, its part of the KV pool, and the command loop."""

    def __init__(self, rank: int, spec: RankSpec) -> None:
        self.rank, self.spec = rank, spec
        self.device = rank_device(torch.device(spec.device), rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        config = spec.config
        hf_config = load_hf_config(spec.model_path)
        self.model = load_model(
            spec.model_path, hf_config, spec.max_model_len, spec.dtype, self.device,
            config.model.quantization, config.model.quantization_group_size,
            shard=TensorParallelShard(rank, spec.world_size),
        )
        self.backend = select_backend(config.model.attention_backend, self.device, spec.dtype, spec.kv_cache_dtype)
        self.num_layers = int(hf_config.num_hidden_layers)
        self.total_kv_heads = self.model.total_kv_heads
        self.kv_heads = kv_heads_of_rank(self.total_kv_heads, spec.world_size, rank)
        self.comm_device = self.device if spec.backend == "nccl" else torch.device("cpu")
        # Connected after loading; the group is joined in run(), once rank 0 heard every rank is ready.
        self._store = dist.TCPStore(
            "127.0.0.1", spec.store_port, is_master=False,
            timeout=datetime.timedelta(seconds=max(config.parallel.collective_timeout_s, STARTUP_TIMEOUT_S)),
        )
        self.group: TensorParallelGroup | None = None
        self.runner: ModelRunner | None = None

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def kv_cache(self) -> KVCache:
        assert self.runner is not None, "the pool exists once run() has started"
        return self.runner.kv_cache

    def run(self) -> None:
        spec, config = self.spec, self.spec.config
        self.group = TensorParallelGroup(
            self._store, self.rank, spec.world_size, spec.backend, config.parallel.collective_timeout_s, self.device
        )
        pool = torch.zeros(2, dtype=torch.long)
        self.group.broadcast(pool)
        num_blocks, paged = pool.tolist()
        # Rank 0's layout, from the same layers; the pages of the blocks a command names come with it.
        layout = PageLayout.of([layer.self_attn.window for layer in self.model.model.layers]) if paged else None
        kv_cache = KVCache(
            self.num_layers, num_blocks, config.cache.block_size, self.model.num_kv_heads,
            self.model.head_dim, spec.kv_cache_dtype, self.device, self.model.kv_parts, layout,
        )
        if layout is not None:
            kv_cache.page_map = PageMirror(layout.num_groups)
        install_all_reduce(self.model, self.group.all_reduce)
        self.runner = ModelRunner(self.model, kv_cache, self.backend, None, self.device)
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        with torch.inference_mode():
            while True:
                self.group.broadcast(header, idle=True)
                command = int(header[0].item())
                if command == Command.SHUTDOWN:
                    return
                if command == Command.STEP:
                    self._step(header)
                elif command == Command.EXPORT:
                    follower_export(self, header)
                elif command == Command.IMPORT:
                    follower_import(self, header)
                else:
                    raise TensorParallelError(f"rank {self.rank} got unknown command {command}")

    def _step(self, header: torch.Tensor) -> None:
        assert self.group is not None and self.runner is not None
        payload = torch.empty(int(header[5]), dtype=torch.long)
        self.group.broadcast(payload)
        inputs = decode_step(
            header, payload, self.spec.config.cache.block_size, self.model.num_heads,
            self.model.num_kv_heads, self.device, self.runner.layer_groups,
        )
        hidden = self.runner.forward(inputs)  # (num_tokens, hidden)
        if inputs.logits_rows is not None:
            send_split_logits(self.model, hidden.index_select(0, inputs.logits_rows), self.group, self.comm_device)
