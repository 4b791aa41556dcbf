"""Rotary position embeddings: inverse frequencies (default and llama3 scaling) and cos/sin tables."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings from a config of either transformers generation.

    transformers 5 keeps them in ``rope_parameters`` (with ``rope_theta``
    inside); older checkpoints use ``rope_theta`` plus ``rope_scaling``.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies for the configured rope type."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: 'default', 'llama3')")


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and
    # the band between them interpolated smoothly.
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for every position up to ``max_positions``, in place of HF's per-call tables."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope_parameters(hf_config), head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (max_positions, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` (num_tokens,), each (num_tokens, 1, head_dim) in ``dtype``: once per step."""
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, heads, head_dim), any heads (queries and keys together), rotated by
    ``RotaryEmbedding.tables``."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
