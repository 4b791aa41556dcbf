"""LoRA adapters: many fine-tunes of one base model served in one batch, never merged into the base weights.

- ``LoRARequest`` (vLLM's name and fields, in pdserve/engine/types/lora.py) names an adapter in PEFT's
  format: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``. ``load_adapter`` reads it, refusing with a message
  naming the adapter what pdserve does not serve (``modules_to_save``, DoRA, embedding or LM-head adapters,
  biases, per-module ranks, a rank above ``max_lora_rank``).
- The per-step machinery (``LoRALinear``: each row's update after its packed projection, on CPU by a C kernel;
  ``LoRARows``, ``LoRAState``) is in pdserve/engine/layers/lora.py; ``install`` wraps a model's projections in it.
- ``LoRAManager`` keeps ``max_loras`` adapters resident in slots (least recently used out, never one a running
  request uses) and up to ``max_cpu_loras`` loaded in host memory.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pdserve.engine.layers.lora import LoRALinear, LoRARows, LoRAState
from pdserve.engine.models.llama import MLP, Attention
from pdserve.engine.native import load_kernel_ops
from pdserve.engine.types.lora import LoRAConfig, LoRARequest

# The projections an adapter may target, as PEFT names them, and the packed projection each one is part of.
TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per (layer, PEFT module name) its ``A`` (rank, in) and ``B`` (out, rank)."""

    name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def load_adapter(request: LoRARequest, max_rank: int, num_layers: int) -> LoRAAdapter:
    """The adapter ``request`` names, read from PEFT's files; ``ValueError`` naming the adapter and what it holds
    that this server does not serve."""
    name, folder = request.lora_name, Path(request.lora_path)
    where = f"LoRA adapter {name!r} ({folder})"
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: cannot read adapter_config.json: {error}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not LoRA")
    refused = [key for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform")
               if config.get(key)]
    if config.get("use_dora"):
        refused.append("use_dora (DoRA)")
    if config.get("bias", "none") != "none":
        refused.append(f"bias {config['bias']!r}")
    if refused:
        raise ValueError(f"{where}: {', '.join(refused)} not served (pdserve serves plain LoRA on "
                         f"{', '.join(TARGETS)})")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"{where}: target_modules {unknown} not served (pdserve serves {', '.join(TARGETS)}: "
                         "not embedding or LM-head adapters)")
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except Exception as error:  # noqa: BLE001 - any unreadable file is the adapter's problem, named
        raise ValueError(f"{where}: cannot read adapter_model.safetensors: {error}") from None
    adapter = LoRAAdapter(name, rank, float(scale))
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(3) not in TARGETS:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight of {', '.join(TARGETS)}")
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ValueError(f"{where}: tensor {key!r} is for layer {layer}; the model has {num_layers}")
        pieces.setdefault((layer, match.group(3)), {})[match.group(4)] = tensor
    for (layer, module), pair in pieces.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(sorted(pair))} without its pair")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{where}: layer {layer} {module} has rank {a.shape[0]}, the config says {rank}")
        adapter.weights[layer, module] = (a.float(), b.float())
    return adapter


class LoRAManager:
    """The adapters of one model: loaded on first use (kept for ``max_cpu_loras``), made resident in one of
    ``max_loras`` slots when a request needs them, the least recently used unpinned one swapped out."""

    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        self.config = config
        self.state = LoRAState(config.max_loras)
        self.layers = install(model, config, self.state)
        self._num_layers = len(self.layers)
        self._host: OrderedDict[str, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()
        self._slots: list[str | None] = [None] * config.max_loras  # adapter name per slot
        self._scales = [0.0] * config.max_loras
        self._pins = [0] * config.max_loras  # unfinished requests using each slot
        self._recent: list[int] = []  # slots, least recently used first

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory (read from its folder the first time); ``ValueError`` naming it."""
        held = self.loaded(request)
        if held is not None:
            return held
        return self.add_loaded(request, self.read(request))

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter read from its folder, not kept: what ``add_loaded`` takes (any thread may call this)."""
        return load_adapter(request, self.config.max_lora_rank, self._num_layers)

    def loaded(self, request: LoRARequest) -> LoRAAdapter | None:
        """The adapter if host memory holds it under this name (None if not); ``ValueError`` when the name holds
        another folder (unload it first). The name is the adapter's identity: ``lora_int_id`` is not compared."""
        held = self._host.get(request.lora_name)
        if held is None:
            return None
        if held[0].lora_path != request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is loaded from {held[0].lora_path}; another "
                             f"path ({request.lora_path}) under the same name is refused until it is unloaded")
        self._host.move_to_end(request.lora_name)
        return held[1]

    def add_loaded(self, request: LoRARequest, adapter: LoRAAdapter) -> LoRAAdapter:
        """Keep ``adapter`` (read by ``read``) in host memory, the least recently used beyond ``max_cpu_loras``
        (and in no slot) dropped."""
        held = self.loaded(request)
        if held is not None:
            return held
        self._host[request.lora_name] = (request, adapter)
        limit = self.config.max_cpu_loras or self.config.max_loras
        for name in list(self._host):
            if len(self._host) <= limit:
                break
            if name not in self._slots:
                del self._host[name]
        return adapter

    def acquire(self, request: LoRARequest) -> int | None:
        """A slot holding the adapter, pinned for one request (swapped in if needed); None when every slot is
        pinned by other adapters' requests (the request waits)."""
        if request.lora_name in self._slots:
            slot = self._slots.index(request.lora_name)
        else:
            free = [slot for slot in range(len(self._slots)) if self._pins[slot] == 0]
            if not free:
                return None
            empty = [slot for slot in free if self._slots[slot] is None]
            slot = empty[0] if empty else min(free, key=lambda s: self._recent.index(s) if s in self._recent else -1)
            adapter = self.load(request)
            for layer, linears in enumerate(self.layers):
                for packed, linear in linears.items():
                    linear.set_slot(slot, {module: pair for (index, module), pair in adapter.weights.items()
                                           if index == layer and TARGETS[module] == packed})
            self._slots[slot] = request.lora_name
            self._scales[slot] = adapter.scale
        self._pins[slot] += 1
        if slot in self._recent:
            self._recent.remove(slot)
        self._recent.append(slot)
        return slot

    def release(self, slot: int) -> None:
        self._pins[slot] -= 1
        assert self._pins[slot] >= 0

    def unload(self, name: str) -> bool:
        """Forget adapter ``name``: no new request gets it (until loaded again); requests running under it keep
        its slot, unnamed, until they finish. False when it was not loaded."""
        known = self._host.pop(name, None) is not None
        if name in self._slots:
            self._slots[self._slots.index(name)] = None
            known = True
        return known

    def resident(self) -> list[str]:
        return [name for name in self._slots if name is not None]

    def held(self) -> list[str]:
        """Every adapter this engine holds: those in slots first, then those in host memory only."""
        resident = self.resident()
        return resident + [name for name in reversed(self._host) if name not in resident]

    def set_rows(self, slots: list[int], num_tokens: list[int], device: torch.device) -> None:
        """The step's rows: each scheduled sequence's slot (-1: the base model) over its ``num_tokens`` tokens."""
        if all(slot < 0 for slot in slots):
            self.state.set(None)
            return
        per_token = torch.tensor(slots).repeat_interleave(torch.tensor(num_tokens))  # (num_tokens,)
        scales = torch.tensor(self._scales + [0.0])[per_token]  # -1 reads the last entry: the base's 0
        self.state.set(LoRARows.of(per_token, scales).to(device))


def install(model: nn.Module, config: LoRAConfig, state: LoRAState) -> list[dict[str, LoRALinear]]:
    """Wrap every decoder layer's packed projections in ``LoRALinear``, the adapters' weights bfloat16 in a
    bfloat16 model and float32 otherwise; per layer, packed name -> wrapper. ``ValueError`` for a model whose
    layers are not Llama-shaped attention and MLP (experts, latent attention)."""
    layers = []
    decoder = model.model  # type: ignore[attr-defined]
    weight = decoder.norm.weight
    kernels = load_kernel_ops() if weight.device.type == "cpu" else None
    dtype = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
    for index, layer in enumerate(decoder.layers):
        attention, mlp = layer.self_attn, layer.mlp
        if not isinstance(attention, Attention) or not isinstance(mlp, MLP):
            raise ValueError(f"LoRA is served on models whose every layer has multi-head attention and a dense MLP; "
                             f"layer {index} has {type(attention).__name__} and {type(mlp).__name__}")
        q = attention.num_heads * attention.head_dim
        kv = attention.num_kv_heads * attention.head_dim
        hidden = weight.shape[0]
        width = mlp.intermediate_size
        shapes = {
            "qkv_proj": (attention, {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}, hidden),
            "o_proj": (attention, {"o_proj": (0, hidden)}, q),
            "gate_up_proj": (mlp, {"gate_proj": (0, width), "up_proj": (width, 2 * width)}, hidden),
            "down_proj": (mlp, {"down_proj": (0, hidden)}, width),
        }
        wrapped = {}
        for packed, (owner, slices, in_features) in shapes.items():
            linear = LoRALinear(getattr(owner, packed), slices, in_features, config.max_loras, config.max_lora_rank,
                                state, weight.device, kernels, dtype)
            setattr(owner, packed, linear)
            wrapped[packed] = linear
        layers.append(wrapped)
    fused = model.fused_decoder  # type: ignore[attr-defined]
    if fused is not None:  # decode steps stay one C call, adapter rows or not
        fused.add_lora(layers, state)
    return layers
