"""Rotary position embeddings: inverse frequencies (default, linear, llama3, YaRN and LongRoPE scaling), cos/sin
tables, and the rotation of the first ``rotary_dim`` features of each head (all of them unless the config sets a
``partial_rotary_factor``), in halves (``apply_rotary``) or in interleaved pairs (``apply_rotary_interleaved``,
DeepSeek's layout)."""

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


def rotary_dim(hf_config: Any, head_dim: int) -> int:
    """How many features of each head rotate: ``head_dim`` times the config's ``partial_rotary_factor``."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return int(head_dim * float(factor if factor is not None else 1.0))


def inverse_frequencies(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies for the configured rope type (``head_dim``: the rotated
    features; LongRoPE's short factors, see ``longrope_attention_factor``)."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    rope_type = params["rope_type"]
    if rope_type == "longrope":
        return 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * base**exponents)
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "yarn":
        return _yarn_scaled(base**exponents, params, head_dim)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported (supported: 'default', 'linear', 'llama3', 'longrope', 'yarn')"
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 where the context is not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: dict[str, Any]) -> float:
    """YaRN's factor on cos and sin, as transformers infers it when the config gives none."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def yarn_softmax_scale(params: dict[str, Any], scale: float) -> float:
    """``scale`` times YaRN's ``mscale_all_dim`` correction squared, as DeepSeek's latent attention scales its
    scores (every feature, not only the rotated ones); unchanged without YaRN."""
    if params.get("rope_type", "default") == "default" or not params.get("mscale_all_dim"):
        return scale
    mscale = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
    return scale * mscale * mscale


def _yarn_scaled(wavelengths: torch.Tensor, params: dict[str, Any], dim: int) -> torch.Tensor:
    # YaRN: frequencies that turn fewer than beta_slow times over the original context are divided by `factor`,
    # those that turn more than beta_fast times kept, and a linear ramp over the features between.
    base, factor = float(params["rope_theta"]), float(params["factor"])
    original = float(params["original_max_position_embeddings"])
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    # Computed as transformers does, so the tables match it to the bit.
    return (1.0 / (factor * wavelengths)) * (1 - extrapolation) + (1.0 / wavelengths) * extrapolation


def longrope_attention_factor(hf_config: Any, params: dict[str, Any]) -> float:
    """LongRoPE's factor on cos and sin, as transformers computes it."""
    original = int(params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings)
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor")
    if factor is None or getattr(hf_config, "original_max_position_embeddings", None):
        factor = hf_config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def check_longrope_length(hf_config: Any, max_positions: int) -> None:
    """ValueError naming max_model_len where LongRoPE would switch to its long factors: transformers switches
    every position of a sequence once it outgrows ``original_max_position_embeddings``, which tables by
    position cannot follow; up to that length the short factors serve exactly."""
    params = rope_parameters(hf_config)
    if params["rope_type"] != "longrope":
        return
    original = int(params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings)
    if max_positions > original:
        raise ValueError(
            f"max_model_len ({max_positions}) exceeds this LongRoPE checkpoint's original_max_position_embeddings "
            f"({original}): its long factors are not served; set max_model_len <= {original} (--max-model-len)"
        )


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

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, params: dict[str, Any] | None = None) -> None:
        """``params``: these RoPE settings instead of the config's own (one layer type's, Gemma 3)."""
        super().__init__()
        if params is not None:
            params = dict(params)
            params.setdefault("rope_type", params.get("type", "default"))
        else:
            params = rope_parameters(hf_config)
        check_longrope_length(hf_config, max_positions)
        dim = rotary_dim(hf_config, head_dim)
        inv_freq = inverse_frequencies(params, dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (max_positions, dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, dim)
        cos, sin = emb.cos(), emb.sin()
        if params["rope_type"] in ("longrope", "yarn"):
            factor = (
                longrope_attention_factor(hf_config, params) if params["rope_type"] == "longrope"
                else yarn_attention_factor(params)
            )
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` (num_tokens,), each (num_tokens, 1, head_dim) in ``dtype``: once per step."""
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, heads, head_dim), any heads (queries and keys together), rotated by
    ``RotaryEmbedding.tables``: its first ``cos.shape[-1]`` features, the rest passed through."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passed = x[..., :dim], x[..., dim:]
    return torch.cat((rotated * cos + _rotate_half(rotated) * sin, passed), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, heads, dim) rotated in adjacent pairs (x0, x1), (x2, x3)... each by one frequency
    (DeepSeek's layout), returned with the pairs' first elements then their second ones, as transformers'
    DeepSeek-V3 lays them out; tables as ``RotaryEmbedding.tables`` gives them (frequencies twice over)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
