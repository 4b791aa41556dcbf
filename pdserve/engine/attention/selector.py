"""Which attention backend an engine runs: the one place that knows every implementation."""

from __future__ import annotations

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.cpu_kernel import KERNEL_KV_DTYPES, KERNEL_QUERY_DTYPES, load_paged_attention_kernel
from pdserve.engine.attention.sdpa import SdpaBackend
from pdserve.engine.types.config import ATTENTION_BACKENDS


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(
    name: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> AttentionBackend:
    """``auto``: flash-attn on CUDA in half precision when it is importable and the KV
    cache has the model's dtype; on CPU the C decode kernel (``cpu_paged``) when it
    builds on this machine and reads the KV dtype (float32, bfloat16, int8) for a
    float32 or bfloat16 model; SDPA otherwise. ``kv_dtype`` None: the model's dtype."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    use_flash = name == "flash_attn" or (
        name == "auto"
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and kv_dtype == dtype
        and flash_attn_available()
    )
    if use_flash:
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend='flash_attn' needs a CUDA device and the flash-attn package")
        if kv_dtype != dtype:
            raise ValueError(f"attention_backend='flash_attn' needs kv_cache_dtype 'auto' (the model's), got {kv_dtype}")
        from pdserve.engine.attention.flash import FlashAttentionBackend

        return FlashAttentionBackend()
    kernel_fits = device.type == "cpu" and dtype in KERNEL_QUERY_DTYPES and kv_dtype in KERNEL_KV_DTYPES
    if name == "sdpa" or (name == "auto" and not kernel_fits):
        return SdpaBackend()
    if not kernel_fits:
        raise ValueError(
            "attention_backend='cpu_paged' needs device 'cpu', dtype float32 or bfloat16 and a KV cache of "
            f"float32, bfloat16 or int8; got {device.type}, {dtype}, KV {kv_dtype}"
        )
    kernel = load_paged_attention_kernel()
    if kernel is None and name == "cpu_paged":
        raise ValueError(
            "attention_backend='cpu_paged' needs pdserve's CPU kernels, and this package was built without them"
        )
    return SdpaBackend(kernel)
