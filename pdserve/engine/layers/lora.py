"""LoRA's per-step machinery: what each projection reads in a step and adds to its rows.

``LoRALinear`` wraps a packed projection (q/k/v, o, gate/up, down): the base projection runs once for the whole
batch; every row then adds its own adapter's update, ``scale * B (A x)`` per module of the pack (the shrink and
expand of Punica and S-LoRA). On CPU a C kernel (pdserve/engine/kernels/lora.c, Punica's BGMV) computes each row
with its own slot's ``A`` and ``B`` only, the rows grouped by slot so that a slot's weights are read once per step;
elsewhere two dense products over all resident adapters, ``(x @ A_all^T) * M`` then each module's ``B_all``, where
``M`` holds each row's scale in its slot's columns and zeros elsewhere: a row of the base model, or of another
adapter, adds exactly nothing from the columns it does not own. The adapters' weights are kept in the model's
dtype where it is bfloat16 (half the bytes a step reads, and the kernel reads them once a step), float32
otherwise; the update is summed in float32 either way. pdserve/engine/lora.py's ``install`` wraps a model's
projections, and points the model's fused decode step (pdserve/engine/models/fused_decode.py) at the same slots:
its decode steps add the same kernel's updates; its ``LoRAManager`` fills the slots and sets each step's
``LoRARows``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.native import KernelOps


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
    """A packed projection plus each row's adapter update (see the module's docstring). Slot ``s`` keeps, in
    ``dtype`` (float32 or bfloat16), the ``A`` of the pack's ``m``-th module (q, k and v each have their own) from
    row ``(s * modules + m) * max_rank`` of ``lora_a``, and every module's ``B`` transposed from row
    ``s * max_rank`` of ``lora_b``, under the module's output columns; ``ranks`` holds each (slot, module)'s rank,
    0 where the adapter leaves the module out. ``kernels``: pdserve/engine/kernels/lora.c's, on CPU (None: torch's
    ops)."""

    def __init__(self, base: nn.Module, slices: dict[str, tuple[int, int]], in_features: int, slots: int,
                 max_rank: int, state: LoRAState, device: torch.device, kernels: KernelOps | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.base = base
        self.slices = slices  # PEFT module name -> its (start, end) output columns in the packed projection
        self.max_rank = max_rank
        self.state = state
        self.kernels = kernels
        self.in_features = in_features
        self.out_features = max(end for _, end in slices.values())
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"LoRA weights are kept float32 or bfloat16, not {dtype}")
        modules = len(slices)
        self.register_buffer("lora_a", torch.zeros(slots * modules * max_rank, in_features, dtype=dtype,
                                                   device=device))
        self.register_buffer("lora_b", torch.zeros(slots * max_rank, self.out_features, dtype=dtype, device=device))
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
                int(self.lora_a.dtype == torch.bfloat16), torch.get_num_threads())
            if status != 0:
                raise MemoryError("the LoRA kernel ran out of memory")
            return out
        # Elsewhere (GPU, a package without its kernels) the dense form: every row by every slot, masked; float32
        # sums, as the kernel's, over bfloat16 weights widened.
        modules = len(self.slices)
        mask = self.state.mask(modules * self.max_rank)
        shrunk = torch.nn.functional.linear(x.to(torch.float32), self.lora_a.float()).mul_(mask)
        shrunk = shrunk.view(-1, self.state.num_slots, modules, self.max_rank)  # (num_tokens, slots, modules, rank)
        update = shrunk.new_zeros(shrunk.shape[0], self.out_features)
        for position, (start, end) in enumerate(self.slices.values()):
            update[:, start:end] = shrunk[:, :, position].flatten(1) @ self.lora_b[:, start:end].float()
        return out.add_(update.to(out.dtype))
