"""LoRA adapters: many fine-tunes of one base model served in one batch, never merged into the base weights.

- ``LoRARequest`` (vLLM's name and fields) names an adapter in PEFT's format: a folder with
  ``adapter_config.json`` and ``adapter_model.safetensors``. ``load_adapter`` reads it, refusing with a message
  naming the adapter what pdserve does not serve (``modules_to_save``, DoRA, embedding or LM-head adapters,
  biases, per-module ranks, a rank above ``max_lora_rank``).
- ``LoRALinear`` wraps a packed projection (q/k/v, o, gate/up, down): the base projection runs once for the
  whole batch; every row then adds its own adapter's update, ``scale * B (A x)`` per module of the pack (the
  shrink and expand of Punica and S-LoRA). On CPU a C kernel (pdserve/engine/kernels/lora.c, Punica's BGMV)
  computes each row with its own slot's ``A`` and ``B`` only, the rows grouped by slot so that a slot's weights
  are read once per step; elsewhere two dense products over all resident adapters, ``(x @ A_all^T) * M`` then
  each module's ``B_all``, where ``M`` holds each row's scale in its slot's columns and zeros elsewhere: a row
  of the base model, or of another adapter, adds exactly nothing from the columns it does not own. A step with
  no adapter row keeps the fused decode step (``BaseStepsOnly``).
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
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.engine.native import KernelOps, load_kernel_ops

if TYPE_CHECKING:
    from pdserve.engine.models.fused_decode import FusedDecoder

# The projections an adapter may target, as PEFT names them, and the packed projection each one is part of.
TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: the adapter's name (what the OpenAI ``model`` field says), a positive integer id
    unique to it, and its folder in PEFT's format."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA settings: ``max_loras`` adapters resident at once, ranks up to ``max_lora_rank``,
    ``max_cpu_loras`` (default ``max_loras``) kept loaded in host memory."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or
                                               self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be None or an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")


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


@dataclass(frozen=True)
class LoRARows:
    """A step's tokens as the projections read them: each one's slot and scale, and the tokens under an adapter
    grouped by slot (the kernel reads a slot's weights once for all its tokens)."""

    slots: torch.Tensor  # (num_tokens,) int64: each token's slot, -1 for the base model
    scales: torch.Tensor  # (num_tokens,) float32: its adapter's scale, 0 for the base model
    order: torch.Tensor  # (num_adapter_tokens,) int64: the tokens with a slot, grouped by slot, in order within one
    group_offsets: torch.Tensor  # (num_groups + 1,) int64: where each slot's group starts in ``order``

    @classmethod
    def of(cls, slots: torch.Tensor, scales: torch.Tensor) -> LoRARows:
        order = (slots >= 0).nonzero().squeeze(1)
        order = order[torch.argsort(slots[order], stable=True)]
        counts = torch.unique_consecutive(slots[order], return_counts=True)[1]
        return cls(slots, scales, order, torch.cat((counts.new_zeros(1), counts.cumsum(0))))

    def to(self, device: torch.device) -> LoRARows:
        return LoRARows(*(tensor.to(device) for tensor in (self.slots, self.scales, self.order, self.group_offsets)))


class LoRAState:
    """What every ``LoRALinear`` of a model reads in a step: its ``LoRARows`` (None: no token has an adapter), and,
    made on first use, the dense path's mask: each token's scale under its slot's columns, per block width."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.rows: LoRARows | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def set(self, rows: LoRARows | None) -> None:
        self.rows, self._masks = rows, {}

    def mask(self, block: int) -> torch.Tensor:
        """(num_tokens, slots * block): each token's scale over its slot's ``block`` columns, zeros elsewhere."""
        assert self.rows is not None
        mask = self._masks.get(block)
        if mask is None:
            slots, scales = self.rows.slots, self.rows.scales
            per_slot = scales.new_zeros(len(slots), self.num_slots + 1)  # a last column for the base rows' -1
            per_slot[torch.arange(len(slots), device=slots.device), slots] = scales
            mask = self._masks[block] = per_slot[:, : self.num_slots].repeat_interleave(block, dim=1)
        return mask


class LoRALinear(nn.Module):
    """A packed projection plus each row's adapter update (see the module's docstring). Slot ``s`` keeps, float32,
    the ``A`` of the pack's ``m``-th module (q, k and v each have their own) from row ``(s * modules + m) *
    max_rank`` of ``lora_a``, and every module's ``B`` transposed from row ``s * max_rank`` of ``lora_b``, under
    the module's output columns; ``ranks`` holds each (slot, module)'s rank, 0 where the adapter leaves the module
    out. ``kernels``: pdserve/engine/kernels/lora.c's, on CPU (None: torch's ops)."""

    def __init__(self, base: nn.Module, slices: dict[str, tuple[int, int]], in_features: int, slots: int,
                 max_rank: int, state: LoRAState, device: torch.device, kernels: KernelOps | None = None) -> None:
        super().__init__()
        self.base = base
        self.slices = slices  # PEFT module name -> its (start, end) output columns in the packed projection
        self.max_rank = max_rank
        self.state = state
        self.kernels = kernels
        self.in_features = in_features
        self.out_features = max(end for _, end in slices.values())
        modules = len(slices)
        self.register_buffer("lora_a", torch.zeros(slots * modules * max_rank, in_features, device=device))
        self.register_buffer("lora_b", torch.zeros(slots * max_rank, self.out_features, device=device))
        self.ranks = torch.zeros(slots, modules, dtype=torch.long)  # read by the kernel, on CPU
        self.columns = torch.tensor(list(slices.values()), dtype=torch.long)  # (modules, 2): start, end

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds these modules' (A, B); the pack's other modules get rank 0 (and zero weights)."""
        modules = len(self.slices)
        self.lora_a[slot * modules * self.max_rank : (slot + 1) * modules * self.max_rank] = 0
        self.lora_b[slot * self.max_rank : (slot + 1) * self.max_rank] = 0
        self.ranks[slot] = 0
        for position, (module, (start, end)) in enumerate(self.slices.items()):
            if module not in weights:
                continue
            a, b = weights[module]
            rank = a.shape[0]
            first = (slot * modules + position) * self.max_rank
            self.lora_a[first : first + rank] = a.to(self.lora_a)
            self.lora_b[slot * self.max_rank : slot * self.max_rank + rank, start:end] = b.T.to(self.lora_b)
            self.ranks[slot, position] = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (num_tokens, in) -> (num_tokens, out)
        out = self.base(x)
        rows = self.state.rows
        if rows is None:
            return out
        if x.shape[0] != rows.slots.shape[0]:
            raise ValueError(f"the step's LoRA rows are for {rows.slots.shape[0]} tokens, the projection got "
                             f"{x.shape[0]}")
        if (self.kernels is not None and x.device.type == "cpu" and x.dim() == 2
                and x.dtype in (torch.float32, torch.bfloat16) and out.dtype == x.dtype):
            out, x = out.contiguous(), x.contiguous()
            status = self.kernels.ops.lora_shrink_expand(
                self.kernels.variant, out, x, self.lora_a, self.lora_b, self.ranks, self.columns, rows.slots,
                rows.scales, rows.order, rows.group_offsets, rows.group_offsets.shape[0] - 1, len(self.slices),
                self.max_rank, self.in_features, self.out_features, int(x.dtype == torch.bfloat16),
                torch.get_num_threads())
            if status != 0:
                raise MemoryError("the LoRA kernel ran out of memory")
            return out
        # Elsewhere (GPU, a package without its kernels) the dense form: every row by every slot, masked.
        modules = len(self.slices)
        mask = self.state.mask(modules * self.max_rank)
        shrunk = torch.nn.functional.linear(x.to(torch.float32), self.lora_a).mul_(mask)
        shrunk = shrunk.view(-1, self.state.num_slots, modules, self.max_rank)  # (num_tokens, slots, modules, rank)
        update = shrunk.new_zeros(shrunk.shape[0], self.out_features)
        for position, (start, end) in enumerate(self.slices.values()):
            update[:, start:end] = shrunk[:, :, position].flatten(1) @ self.lora_b[:, start:end]
        return out.add_(update.to(out.dtype))


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
    """Wrap every decoder layer's packed projections in ``LoRALinear``; per layer, packed name -> wrapper.
    ``ValueError`` for a model whose layers are not Llama-shaped attention and MLP (experts, latent attention)."""
    from pdserve.engine.models.llama import MLP, Attention

    layers = []
    decoder = model.model  # type: ignore[attr-defined]
    weight = decoder.norm.weight
    kernels = load_kernel_ops() if weight.device.type == "cpu" else None
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
                                state, weight.device, kernels)
            setattr(owner, packed, linear)
            wrapped[packed] = linear
        layers.append(wrapped)
    fused = model.fused_decoder  # type: ignore[attr-defined]
    model.fused_decoder = None if fused is None else BaseStepsOnly(fused, state)  # type: ignore[attr-defined]
    return layers


class BaseStepsOnly:
    """The fused decode step (pdserve/engine/models/fused_decode.py) for the steps where no token has an adapter:
    it runs the base projections, not their ``LoRALinear`` wrappers, which then add nothing anyway."""

    def __init__(self, decoder: FusedDecoder, state: LoRAState) -> None:
        self.decoder, self.state = decoder, state

    def serves(self, num_tokens: int, attn_metadata: Any) -> bool:
        return self.state.rows is None and self.decoder.serves(num_tokens, attn_metadata)

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.decoder(*args)
