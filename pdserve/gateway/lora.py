"""The LoRA adapters a gateway serves: their names, folders and ids, and the flags that set them (vLLM's).

``--lora-modules`` names adapters at start (``name=path``, or vLLM's JSON form
``{"name": ..., "path": ..., "base_model_name": ...}``); with
``--allow-runtime-lora-updating``, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` add and remove them while the gateway serves. The
gateway reads no weights: a request names its adapter to the workers by name,
id and folder (``worker_pb2.LoRAAdapter``), and a worker that does not hold it
reads it from that folder first. Torch-free, as the rest of the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.gateway.workers import WorkerHandle, WorkerPool
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.errors import Unavailable


@dataclass(frozen=True)
class LoRAModule:
    """One adapter: the name requests use, its folder in PEFT's format, its id, and the base it was trained on
    (``parent`` in ``/v1/models``; None: the served model)."""

    name: str
    path: str
    id: int = 0
    base_model_name: str | None = None

    def to_proto(self) -> worker_pb2.LoRAAdapter:
        return worker_pb2.LoRAAdapter(name=self.name, id=self.id, path=self.path)

    def to_arg(self) -> str:
        """This adapter as a ``--lora-modules`` value (what ``lora_module`` reads back)."""
        if self.base_model_name is None and "=" not in self.name and not self.name.startswith("{"):
            return f"{self.name}={self.path}"
        return json.dumps({"name": self.name, "path": self.path, "base_model_name": self.base_model_name})


def lora_module(text: str) -> LoRAModule:
    """One ``--lora-modules`` value: ``name=path`` or a JSON object with ``name``, ``path`` and optionally
    ``base_model_name``; ``argparse.ArgumentTypeError`` saying what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r} is not valid JSON: {error}") from None
        unknown = sorted(set(value) - {"name", "path", "base_model_name"}) if isinstance(value, dict) else []
        if not isinstance(value, dict) or unknown:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected an object with name, path and "
                                             f"optionally base_model_name{f'; unknown: {unknown}' if unknown else ''}")
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    for field, given in (("name", name), ("path", path)):
        if not isinstance(given, str) or not given.strip():
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: {field} must be a non-empty string")
    if base is not None and (not isinstance(base, str) or not base):
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: base_model_name must be a non-empty string")
    return LoRAModule(name.strip(), path.strip(), base_model_name=base)


def add_lora_module_arguments(parser: argparse.ArgumentParser, whose: str) -> None:
    """``--enable-lora`` and ``--lora-modules`` (vLLM's names)."""
    parser.add_argument("--enable-lora", action="store_true",
                        help=f"serve LoRA adapters {whose}(implied by --lora-modules)")
    parser.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module, default=[],
                        metavar="NAME=PATH",
                        help="LoRA adapters in PEFT's format, each name=path or '{\"name\": ..., \"path\": ..., "
                        "\"base_model_name\": ...}'; a request selects one by name (the OpenAI model field, "
                        "gRPC lora_name)")


def add_lora_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's LoRA sizes (vLLM's names)."""
    parser.add_argument("--max-loras", type=int, default=1,
                        help="LoRA adapters resident at once (in one batch); others wait for a slot (default 1)")
    parser.add_argument("--max-lora-rank", type=int, default=16,
                        help="the largest adapter rank served; a higher one is refused at load (default 16)")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="LoRA adapters kept read in host memory, resident ones included (default: --max-loras)")


class UnknownAdapter(KeyError):
    """A request names an adapter this gateway does not serve (gRPC NOT_FOUND, HTTP 404)."""


class LoRAAdapters:
    """The adapters this gateway serves, by name, each with an id of its own (in order of registration)."""

    def __init__(self, modules: list[LoRAModule] = (), enabled: bool = True,  # type: ignore[assignment]
                 allow_runtime_updating: bool = False) -> None:
        self.enabled = enabled or bool(modules) or allow_runtime_updating
        self.allow_runtime_updating = allow_runtime_updating
        self._modules: dict[str, LoRAModule] = {}
        self._next_id = 1
        for module in modules:
            self.add(module.name, module.path, module.base_model_name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRAModule:
        """Register an adapter; ``ValueError`` when the name is taken."""
        if name in self._modules:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        module = LoRAModule(name, path, self._next_id, base_model_name)
        self._next_id += 1
        self._modules[name] = module
        return module

    def remove(self, name: str) -> LoRAModule:
        module = self._modules.pop(name, None)
        if module is None:
            raise UnknownAdapter(f"The lora adapter '{name}' cannot be found.")
        return module

    def get(self, name: str) -> LoRAModule:
        """The adapter ``name``; ``UnknownAdapter`` when this gateway does not serve it."""
        module = self._modules.get(name)
        if module is None:
            served = ", ".join(sorted(self._modules)) or "none"
            raise UnknownAdapter(f"lora_name {name!r} is not a LoRA adapter this server serves (served: {served})")
        return module

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def __iter__(self):  # noqa: ANN204
        return iter(list(self._modules.values()))

    def __len__(self) -> int:
        return len(self._modules)


async def load_everywhere(pool: WorkerPool, adapters: LoRAAdapters, name: str, path: str) -> None:
    """Register adapter ``name`` once every healthy worker has read it from ``path`` (``/v1/load_lora_adapter``);
    ``ValueError`` naming it when the name is taken or a worker cannot serve it (the first worker's message, and
    nothing stays registered). Workers that start later read it when a request first needs it."""
    adapter = adapters.add(name, path).to_proto()
    try:
        await _on_every_worker(pool, lambda worker: worker.stub.LoadLoRAAdapter(
            worker_pb2.LoadLoRAAdapterRequest(lora=adapter), timeout=60))
    except BaseException:
        adapters.remove(name)
        await _on_every_worker(pool, lambda worker: worker.stub.UnloadLoRAAdapter(
            worker_pb2.UnloadLoRAAdapterRequest(name=name), timeout=30), raise_errors=False)
        raise


async def unload_everywhere(pool: WorkerPool, adapters: LoRAAdapters, name: str) -> None:
    """Stop serving adapter ``name`` (``UnknownAdapter`` when not served) and have every reachable worker forget
    it: requests running under it finish, new ones are NOT_FOUND."""
    adapters.remove(name)
    await _on_every_worker(pool, lambda worker: worker.stub.UnloadLoRAAdapter(
        worker_pb2.UnloadLoRAAdapterRequest(name=name), timeout=30), tolerate_unavailable=True)


async def _on_every_worker(pool: WorkerPool, call: Callable[[WorkerHandle], Awaitable[Any]],
                           tolerate_unavailable: bool = False, raise_errors: bool = True) -> None:
    """``call(worker)`` on each healthy worker (a colocated one once), concurrently; then the first error: a
    worker's INVALID_ARGUMENT as ``ValueError``, others as ``Unavailable`` (an unreachable worker skipped with
    ``tolerate_unavailable``); none with ``raise_errors`` False."""
    workers = {w.address: w for w in pool.healthy("prefill") + pool.healthy("decode")}
    if not workers and raise_errors and not tolerate_unavailable:
        raise Unavailable("no worker is available")
    results = await asyncio.gather(*(call(worker) for worker in workers.values()), return_exceptions=True)
    for result in results if raise_errors else ():
        if isinstance(result, grpc.aio.AioRpcError):
            if tolerate_unavailable and result.code() == grpc.StatusCode.UNAVAILABLE:
                continue
            if result.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(result.details())
            raise Unavailable(f"a worker failed: {result.code().name}: {result.details()}")
        if isinstance(result, BaseException):
            raise result
