"""The decoder's fused elementwise steps on CPU (``pdserve/engine/kernels/fused_ops.c``), as torch operators.

``FusedOps.rms_norm`` adds a sublayer's output into the residual stream and
normalises it in one pass; ``FusedOps.silu_mul`` is the MLP's activation times
its up projection. Each replaces several torch ops, and at decode batch sizes
it is the ops' dispatch that costs, not their arithmetic.

The model uses them in bfloat16. They round where the torch ops they replace
round; what differs is the order of one float32 sum (the norm's sum of
squares) and a few ulp of exp, so a result is now and then one bfloat16 step
from torch's (tests/unit/test_fused_ops.py, and
tests/integration/test_quantized_generation.py for whole generations).
Float32 is the exactness oracle: it keeps torch's ops, as does every model
the kernels cannot serve (GPU, float16, a package built without its kernels).
"""

from __future__ import annotations

import torch

from pdserve.engine.native import KernelOps, load_kernel_ops

# What the kernels compute; the model dtype they are used for (see the module docstring).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MODEL_DTYPES = (torch.bfloat16,)


class FusedOps:
    """The fused ops of one kernel variant; tensors must be contiguous CPU float32 or bfloat16 of one dtype."""

    def __init__(self, kernels: KernelOps) -> None:
        self._ops, self._variant = kernels.ops, kernels.variant
        self.isa = kernels.name

    def rms_norm(
        self,
        residual: torch.Tensor,  # (rows, width): updated in place to residual + delta when delta is given
        weight: torch.Tensor,  # (width,)
        eps: float,
        delta: torch.Tensor | None = None,  # (rows, width)
    ) -> torch.Tensor:  # (rows, width): weight * normalised residual
        _check("residual", residual)
        _check("weight", weight, residual.dtype)
        if delta is not None:
            _check("delta", delta, residual.dtype)
            if delta.shape != residual.shape:
                raise ValueError(f"delta {tuple(delta.shape)} must have the residual's shape {tuple(residual.shape)}")
        rows, width = residual.shape
        if weight.shape != (width,):
            raise ValueError(f"weight {tuple(weight.shape)} must be ({width},)")
        out = torch.empty_like(residual)
        self._ops.rms_norm(self._variant, out, residual, delta, weight, rows, width, eps,
                           int(residual.dtype == torch.bfloat16))
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # (rows, 2 * width) -> (rows, width)
        _check("gate_up", gate_up)
        rows, double_width = gate_up.shape
        out = gate_up.new_empty(rows, double_width // 2)
        self._ops.silu_mul(self._variant, out, gate_up, rows, double_width // 2, int(gate_up.dtype == torch.bfloat16))
        return out


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    # The C side trusts these layouts; anything else would read the wrong memory.
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name} must be a contiguous CPU float32 or bfloat16 tensor")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")


def load_fused_ops(device: torch.device, dtype: torch.dtype, variant: str | None = None) -> FusedOps | None:
    """The fused ops for a model on ``device`` in ``dtype``; None where they do not apply or were not built.
    ``variant``: the kernels' ISA variant (``pdserve.engine.native.load_kernel_ops``)."""
    if device.type != "cpu" or dtype not in MODEL_DTYPES:
        return None
    kernels = load_kernel_ops(variant)
    return None if kernels is None else FusedOps(kernels)
