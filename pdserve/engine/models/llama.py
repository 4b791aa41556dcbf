"""The shared decoder over a flattened token batch and a paged KV cache, and Llama (SmolLM) built from it.

The building blocks (attention with optional q/k norms, windows, soft-caps and
partial rotary; the gated MLP; one mixture-of-experts layer; pre-, post- or
sandwich-norm decoder layers) serve every family: each is a short class in a
file of its own (``mistral.py``, ``qwen.py``, ``gemma.py``, ``phi3.py``,
``olmo2.py``, ``mixtral.py``, ``deepseek.py``) that picks its ``FamilyOptions``,
and ``models/__init__.py`` maps a checkpoint's ``architectures`` to them.
Parameter names match Hugging Face's classes so checkpoints load by name. After loading, ``pack_weights(method)`` fuses the
projections that share an input (q/k/v, gate/up) into one ``PackedLinear`` each,
whose linear method (pdserve/engine/layers/linear.py) decides how the matrix is kept
and multiplied: float32 in MKL's packed GEMM format on CPU (about three times
faster than ``F.linear`` at decode batch sizes, BENCHMARKS.md), bf16, INT8 or
INT4. Every forward works on the tokens of one engine step flattened into a
single dimension: no padding, no batch dimension.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend, LayerMetadata
from pdserve.engine.layers.fused_ops import FusedOps, load_fused_ops
from pdserve.engine.layers.linear import (
    GroupedDenseGemm,
    GroupedQuantizedGemm,
    LinearMethod,
    PackedLinear,
    UnquantizedLinearMethod,
)
from pdserve.engine.models.fused_decode import FusedDecoder, build_fused_decoder
from pdserve.engine.models.rope import RotaryEmbedding, apply_rotary


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


_ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
}


class RMSNorm(nn.Module):
    """RMSNorm of the residual stream, after adding the previous sublayer's output into it (``delta``).

    ``offset`` 1.0: the weight is stored as w - 1 and multiplies as (1 + w), in float32 (Gemma's norms)."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if offset else torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset
        self.fused: FusedOps | None = None

    def forward(
        self,
        residual: torch.Tensor,  # (num_tokens, hidden); updated in place to residual + delta
        delta: torch.Tensor | None = None,  # (num_tokens, hidden)
    ) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(residual, self.weight, self.eps, delta)
        if delta is not None:
            residual.add_(delta)
        return rms_norm(residual, self.weight, self.eps, self.offset)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dimension, normalised in float32 whatever x's dtype, as the references do; with
    ``offset`` (Gemma) the float32 result is multiplied by (offset + weight) in float32, then cast."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x32 * (offset + weight.to(torch.float32))).to(x.dtype)
    return weight * x32.to(x.dtype)


class PlainRMSNorm(nn.Module):
    """An RMSNorm with only a weight (``rms_norm``): the q/k norms, and norms that add nothing to the residual."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


# Where a family normalises queries and keys before the rotation: per head over head_dim (Qwen3), or over
# every head of the projection at once (OLMo 2).
QK_NORMS = (None, "head", "all_heads")


class Attention(nn.Module):
    def __init__(
        self,
        config: Any,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: str | None = None,
        window: int | None = None,
        norm_offset: float = 0.0,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        # A sliding-window layer's window (None: the whole context).
        self.window = window
        # The scores' factor (None: head_dim ** -0.5) and soft-cap (None: none), passed to the backend.
        self.attention_options: dict[str, Any] = {}
        if window is not None:
            self.attention_options["window"] = window
        if scale is not None:
            self.attention_options["scale"] = scale
        if softcap is not None:
            self.attention_options["softcap"] = softcap
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm = PlainRMSNorm(self.head_dim, config.rms_norm_eps, norm_offset)
            self.k_norm = PlainRMSNorm(self.head_dim, config.rms_norm_eps, norm_offset)
        elif qk_norm == "all_heads":
            self.q_norm = PlainRMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps, norm_offset)
            self.k_norm = PlainRMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps, norm_offset)

    def pack_weights(self, method: LinearMethod) -> None:
        self.qkv_proj = PackedLinear([self.q_proj, self.k_proj, self.v_proj], method)
        self.o_proj = PackedLinear([self.o_proj], method)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        hidden: torch.Tensor,  # (num_tokens, hidden)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: (num_tokens, 1, head_dim) each
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(n, heads + 2 * kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qkv = self._normalise_qk(qkv)
        # Queries and keys are adjacent columns, so one rotation covers both.
        qk = apply_rotary(qkv[:, : heads + kv_heads], *rope)  # (n, heads + kv_heads, head_dim)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, heads + kv_heads :]  # (n, kv_heads, head_dim)
        # (n, heads, head_dim)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata, **self.attention_options)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))

    def _normalise_qk(self, qkv: torch.Tensor) -> torch.Tensor:  # (n, heads + 2 * kv_heads, head_dim)
        n, heads, kv_heads = qkv.shape[0], self.num_heads, self.num_kv_heads
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        else:  # every head of the projection at once
            q = self.q_norm(q.reshape(n, -1)).view(n, heads, -1)
            k = self.k_norm(k.reshape(n, -1)).view(n, kv_heads, -1)
        return torch.cat((q, k, v), dim=1)


class MLP(nn.Module):
    def __init__(self, config: Any, bias: bool, intermediate_size: int | None = None) -> None:
        super().__init__()
        intermediate = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=bias)
        # Gemma's configs name it hidden_activation.
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]
        self.intermediate_size = intermediate
        # Fused silu(gate) * up (only ever set for silu).
        self.fused: FusedOps | None = None

    def pack_weights(self, method: LinearMethod) -> None:
        self.gate_up_proj = PackedLinear([self.gate_proj, self.up_proj], method)
        self.down_proj = PackedLinear([self.down_proj], method)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (num_tokens, 2 * intermediate)
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        # One fresh (contiguous) temporary, multiplied in place: at prefill sizes
        # the (tokens, intermediate) temporaries are large, and fresh allocations
        # cost page faults on CPU.
        hidden = self.act(gate)
        return self.down_proj(hidden.mul_(up))


GroupedGemm = GroupedQuantizedGemm | GroupedDenseGemm


@dataclass(frozen=True)
class MoEOptions:
    """A mixture-of-experts layer's shape and routing."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # Renormalise the top-k probabilities to sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob).
    normalise: bool
    # The routing weights cast to the model dtype before they scale the experts' outputs (Qwen3-MoE), or
    # kept in float32 (Mixtral).
    weights_in_model_dtype: bool
    # DeepSeek's routing. "softmax" or "sigmoid" scores (sigmoid: chosen by score + a learnt correction bias,
    # weighted by the score alone; V3).
    scoring: str = "softmax"
    # Group-limited choice: the experts fall in ``num_groups`` groups, each scored by its best expert ("max",
    # V2's group_limited_greedy) or its best two summed ("top2_sum", V3); only the ``topk_groups`` best groups'
    # experts can be chosen. None: any expert.
    group_limit: str | None = None
    num_groups: int = 1
    topk_groups: int = 1
    # Added to the normalising sum (V3's 1e-20), and the routed experts' weights' factor.
    normalise_eps: float = 0.0
    routed_scale: float = 1.0
    # Always-on experts whose MLP of this width is added to every token's routed sum (0: none).
    shared_intermediate_size: int = 0
    # The router kept and computed in float32 whatever the model's dtype (DeepSeek).
    router_in_float32: bool = False


class MoE(nn.Module):
    """Top-k routed experts: a softmax router, then the tokens grouped by expert and each active expert's
    gated MLP run once over its tokens (one GEMM per projection, through the model's linear method: float,
    INT8 or INT4 like every projection). Each token's output is the sum over its experts in expert order,
    weighted by its routing weights, as transformers adds them."""

    def __init__(self, config: Any, options: MoEOptions, bias: bool) -> None:
        super().__init__()
        if options.scoring not in ("softmax", "sigmoid") or options.group_limit not in (None, "max", "top2_sum"):
            raise ValueError(f"unsupported routing: scoring {options.scoring!r}, group limit {options.group_limit!r}")
        if options.group_limit and options.num_experts % options.num_groups:
            raise ValueError(f"n_group ({options.num_groups}) must divide the {options.num_experts} experts")
        self.options = options
        router_dtype = torch.float32 if options.router_in_float32 else None
        self.gate = nn.Linear(config.hidden_size, options.num_experts, bias=False, dtype=router_dtype)  # the router
        if options.scoring == "sigmoid":
            # The checkpoint's mlp.gate.e_score_correction_bias: shifts which experts are chosen, not their weights.
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(options.num_experts, dtype=torch.float32), requires_grad=False
            )
        self.experts = nn.ModuleList(
            MLP(config, bias, options.intermediate_size) for _ in range(options.num_experts)
        )
        self.shared_experts = (
            MLP(config, bias, options.shared_intermediate_size) if options.shared_intermediate_size else None
        )
        self.act = self.experts[0].act
        self.fused: FusedOps | None = None  # no fused activation: each expert's own (MoE.pack_weights)
        # Set by pack_weights: each projection of every expert in one call (gate/up, down).
        self.grouped: tuple[GroupedGemm, GroupedGemm] | None = None

    def mlps(self) -> list[MLP]:
        """Every MLP of the layer: the routed experts, then the shared one where there is one."""
        return [*self.experts, *([self.shared_experts] if self.shared_experts is not None else [])]

    def pack_weights(self, method: LinearMethod) -> None:
        for mlp in self.mlps():
            mlp.pack_weights(method)
        # Each projection of every expert in one kernel call: quantized, or float32 where the weights are the
        # dense kernel's panels (None: one call per expert).
        gate_ups = [expert.gate_up_proj for expert in self.experts]
        downs = [expert.down_proj for expert in self.experts]
        if GroupedQuantizedGemm.serves(gate_ups) and GroupedQuantizedGemm.serves(downs):
            self.grouped = (GroupedQuantizedGemm(gate_ups), GroupedQuantizedGemm(downs))
        elif GroupedDenseGemm.serves(gate_ups) and GroupedDenseGemm.serves(downs):
            self.grouped = (GroupedDenseGemm(gate_ups), GroupedDenseGemm(downs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (num_tokens, hidden)
        routed = self._routed(x)
        if self.shared_experts is not None:
            routed.add_(self.shared_experts(x))
        return routed

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, (num_tokens, top_k) each, as the family's router picks them."""
        options = self.options
        if options.router_in_float32:
            logits = nn.functional.linear(x.float(), self.gate.weight.float())
        else:
            logits = nn.functional.linear(x, self.gate.weight)  # (num_tokens, num_experts)
        if options.scoring == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            choice = scores
        else:
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias
        if options.group_limit is not None:
            grouped = choice.view(x.shape[0], options.num_groups, -1)  # (num_tokens, groups, experts per group)
            if options.group_limit == "max":
                group_scores = grouped.max(dim=-1).values
            else:
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            groups = torch.topk(group_scores, options.topk_groups, dim=-1)[1]
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            kept = kept.unsqueeze(-1).expand_as(grouped).reshape(x.shape[0], -1)
            # V2 zeroes the other groups' softmax scores, V3 rules them out.
            choice = choice.masked_fill(~kept, 0.0 if options.scoring == "softmax" else float("-inf"))
        if options.scoring == "softmax":
            weights, chosen = torch.topk(choice, options.top_k, dim=-1)  # (num_tokens, top_k) each
        else:
            chosen = torch.topk(choice, options.top_k, dim=-1)[1]
            weights = scores.gather(1, chosen)
        if options.normalise:
            weights /= weights.sum(dim=-1, keepdim=True) + options.normalise_eps
        if options.routed_scale != 1.0:
            weights = weights * options.routed_scale
        if options.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, chosen

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        options = self.options
        weights, chosen = self.route(x)
        num_tokens = x.shape[0]
        if num_tokens == 1 and self.grouped is None:
            # One token (a batch-1 decode step): its experts in ascending order, summed in that order.
            out: torch.Tensor | None = None
            for expert_index, weight in sorted(zip(chosen[0].tolist(), weights[0])):
                produced = (self.experts[expert_index](x) * weight).to(x.dtype)
                out = produced if out is None else out.add_(produced)
            assert out is not None
            return out
        # Every (token, choice) pair sorted by expert, within an expert rank-major as transformers takes them:
        # one gather of the rows, one contiguous slice per active expert, one scatter-add at the end.
        pairs = chosen.t().reshape(-1)  # pair r * num_tokens + t: token t's r-th choice
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=options.num_experts).tolist()
        tokens = order % num_tokens
        rows = x.index_select(0, tokens)
        if self.grouped is not None and max(counts) <= self.grouped[0].max_rows:
            produced = self._grouped_experts(rows, counts)
        else:
            produced = torch.empty_like(rows)
            start = 0
            for expert_index, count in enumerate(counts):
                if count:
                    produced[start : start + count] = self.experts[expert_index](rows[start : start + count])
                    start += count
        produced = (produced * weights.t().reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
        # index_add_ adds each row in turn: a token's experts in ascending order, as transformers sums them.
        return torch.zeros_like(x).index_add_(0, tokens, produced)

    def _grouped_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert's MLP over its rows (sorted by expert, ``counts`` each) in two kernel calls, bit for bit
        what each expert's own ``MLP.forward`` gives its rows."""
        assert self.grouped is not None
        gate_up_gemm, down_gemm = self.grouped
        offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
        gate_up = gate_up_gemm(rows, offsets)  # (rows, 2 * intermediate)
        expert = self.experts[0]
        if expert.fused is not None:
            hidden = expert.fused.silu_mul(gate_up)
        else:
            width = expert.intermediate_size
            hidden = expert.act(gate_up[:, :width]).mul_(gate_up[:, width:])
        return down_gemm(hidden, offsets)


@dataclass(frozen=True)
class FamilyOptions:
    """What a family changes in the shared decoder."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str | None = None  # one of QK_NORMS
    # "pre": norm before each sublayer (Llama); "post": norm of each sublayer's output before it joins the
    # residual, none before (OLMo 2); "sandwich": both (Gemma 2 and 3).
    norm_placement: str = "pre"
    # Gemma: every norm multiplies by (1 + w); the embeddings are scaled by sqrt(hidden_size).
    norm_offset: float = 0.0
    embed_scale: bool = False
    # The attention scores' factor (None: head_dim ** -0.5) and soft-caps of the scores and the logits.
    attention_scale: float | None = None
    attention_softcap: float | None = None
    final_softcap: float | None = None
    # Mixture of experts in the layers ``moe_layers`` names (None: dense MLPs everywhere).
    moe: MoEOptions | None = None
    moe_layers: tuple[int, ...] = ()
    # Builds a family's own attention from the config (DeepSeek's latent attention); None: ``Attention``.
    attention: Callable[[Any], nn.Module] | None = None


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, options: FamilyOptions, window: int | None = None, sparse: bool = False) -> None:
        super().__init__()
        self.norm_placement = options.norm_placement
        # Norms that never add into the residual themselves (the fused residual-add norm is "pre"'s).
        self.post_norms = options.norm_placement in ("post", "sandwich")
        hidden, eps, offset = config.hidden_size, config.rms_norm_eps, options.norm_offset
        if options.norm_placement == "pre":
            self.input_layernorm = RMSNorm(hidden, eps, offset)
            self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        else:
            if options.norm_placement == "sandwich":
                self.input_layernorm = PlainRMSNorm(hidden, eps, offset)
                self.pre_feedforward_layernorm = PlainRMSNorm(hidden, eps, offset)
            self.post_attention_layernorm = PlainRMSNorm(hidden, eps, offset)
            self.post_feedforward_layernorm = PlainRMSNorm(hidden, eps, offset)
        self.self_attn: nn.Module = options.attention(config) if options.attention is not None else Attention(
            config, options.qkv_bias, options.o_bias, options.qk_norm, window, offset,
            options.attention_scale, options.attention_softcap,
        )
        self.mlp: MLP | MoE
        if sparse:
            assert options.moe is not None
            self.mlp = MoE(config, options.moe, options.mlp_bias)
        else:
            self.mlp = MLP(config, options.mlp_bias)

    def forward(
        self,
        residual: torch.Tensor,  # (num_tokens, hidden): the residual stream, updated in place
        delta: torch.Tensor | None,  # the previous layer's MLP output, not yet added (None before layer 0)
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:  # this layer's MLP output, for the next norm to add
        if self.post_norms:
            # Each sublayer's output is normalised, then added; "sandwich" also normalises its input.
            if delta is not None:
                residual.add_(delta)
            sandwich = self.norm_placement == "sandwich"
            attn_in = self.input_layernorm(residual) if sandwich else residual
            attn_out = self.self_attn(attn_in, rope, kv_cache, backend, attn_metadata)
            residual.add_(self.post_attention_layernorm(attn_out))
            mlp_in = self.pre_feedforward_layernorm(residual) if sandwich else residual
            return self.post_feedforward_layernorm(self.mlp(mlp_in))
        # Each sublayer's output is added into the residual by the norm after it (fused on CPU in bf16).
        attn_out = self.self_attn(self.input_layernorm(residual, delta), rope, kv_cache, backend, attn_metadata)
        return self.mlp(self.post_attention_layernorm(residual, attn_out))


class DecoderModel(nn.Module):
    def __init__(self, config: Any, max_positions: int, options: FamilyOptions) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # A window no sequence outgrows (max_positions) changes nothing: those layers attend to everything.
        windows = [w if w is not None and w < max_positions else None for w in sliding_windows(config)]
        self.layers = nn.ModuleList(
            DecoderLayer(config, options, window, index in options.moe_layers) for index, window in enumerate(windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.norm_offset)
        # The features RoPE turns: a head's (latent attention: its decoupled rope part).
        head_dim = getattr(self.layers[0].self_attn, "rope_head_dim", self.layers[0].self_attn.head_dim)
        # Gemma 3 rotates its sliding layers with their own RoPE (rope_parameters by layer type).
        by_type = layer_rope_parameters(config)
        self.rotary = RotaryEmbedding(config, head_dim, max_positions, by_type.get("full_attention"))
        self.rotary_local: RotaryEmbedding | None = None
        if "sliding_attention" in by_type:
            self.rotary_local = RotaryEmbedding(config, head_dim, max_positions, by_type["sliding_attention"])
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(self.layers)
        for layer, kind in zip(self.layers, layer_types):
            layer.local_rope = self.rotary_local is not None and kind == "sliding_attention"
        # sqrt(hidden_size) in the model dtype, as Gemma's scaled embedding multiplies (None: no scaling).
        self.embed_scale = float(config.hidden_size) ** 0.5 if options.embed_scale else None
        self.final_softcap = options.final_softcap


def layer_rope_parameters(config: Any) -> dict[str, dict[str, Any]]:
    """RoPE settings by layer type where the config keeps them so (Gemma 3: "full_attention" and
    "sliding_attention"); empty for a config with one setting for every layer."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return {kind: dict(value) for kind, value in params.items() if isinstance(value, dict)}
    return {}


class LlamaForCausalLM(nn.Module):
    """Llama family: GQA, RoPE (default or llama3 scaling), tied or untied embeddings."""

    # Whether the fused C decode step (models/fused_decode.py) computes this family's layers: Llama's
    # layout only (no q/k norms, pre-norms).
    fused_decode_layout = True
    # Whether a tensor-parallel rank can compute its heads' part alone (not where a norm spans every head).
    tensor_parallel_reason: str | None = None

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self._build(config, max_positions, self.family_options(config))

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return FamilyOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def _build(self, config: Any, max_positions: int, options: FamilyOptions) -> None:
        self.config = config
        # Set by pack_weights; None: every step runs layer by layer.
        self.fused_decoder: FusedDecoder | None = None
        # Called between two layers of a layer-by-layer step (LLMEngine.between_layers).
        self.between_layers: Callable[[], None] | None = None
        self.model = DecoderModel(config, max_positions, options)
        attention = self.model.layers[0].self_attn
        if (
            any(layer.self_attn.window is not None for layer in self.model.layers)
            or self.model.rotary.cos.shape[-1] != attention.head_dim
            or options.moe_layers
        ):
            # The fused C step attends to the whole context, rotates every feature of a head, has no experts.
            self.fused_decode_layout = False
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def pack_weights(self, method: LinearMethod | None = None, lm_head_method: LinearMethod | None = None) -> None:
        """Fuse the loaded projections that share an input (see the module docstring); call once, after loading.

        On CPU in bf16 the norms (with the residual adds) and the MLP's activation
        also switch to fused C kernels (pdserve/engine/layers/fused_ops.py).

        ``method`` (default: unquantized) serves the decoder's projections and
        ``lm_head_method`` (default: unquantized, as in vLLM) the LM head. An
        unquantized tied head is the embedding's tensor; a quantized head is a
        copy beside it (the embedding lookup keeps the floats).
        """
        method = method or UnquantizedLinearMethod()
        if hasattr(self, "lm_head_packed"):
            raise RuntimeError("pack_weights() was already called")
        with torch.no_grad():
            for layer in self.model.layers:
                layer.self_attn.pack_weights(method)
                layer.mlp.pack_weights(method)
            # A tied head stays the embedding's tensor (PackedLinear does not copy a single matrix).
            self.lm_head_packed = PackedLinear([self.lm_head], lm_head_method)
            del self.lm_head
        weight = self.model.norm.weight
        fused = load_fused_ops(weight.device, weight.dtype)
        if fused is not None:
            for layer in self.model.layers:
                if not layer.post_norms:
                    layer.input_layernorm.fused = layer.post_attention_layernorm.fused = fused
                for mlp in layer.mlp.mlps() if isinstance(layer.mlp, MoE) else [layer.mlp]:
                    if mlp.act is nn.functional.silu:
                        mlp.fused = fused
            if not self.model.norm.offset:
                self.model.norm.fused = fused
        # Decode steps in one C call where the model's layout allows (None elsewhere; see forward).
        self.fused_decoder = build_fused_decoder(self) if self.fused_decode_layout else None

    @property
    def num_heads(self) -> int:
        """Query heads of this model's attention (this rank's, under tensor parallelism)."""
        return self.model.layers[0].self_attn.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Features of one cached row per KV head (latent attention: the latent and its rope part)."""
        return self.model.layers[0].self_attn.head_dim

    @property
    def total_kv_heads(self) -> int:
        """KV heads of the whole model, every rank's together: what a handoff carries."""
        attention = self.model.layers[0].self_attn
        if getattr(attention, "kv_parts", 2) == 1:
            return attention.num_kv_heads
        return int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)

    @property
    def kv_parts(self) -> int:
        """Cached rows per token and layer: 2 (keys and values) or 1 (a latent; engine.types.handoff.KV_PARTS)."""
        return getattr(self.model.layers[0].self_attn, "kv_parts", 2)

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:  # (num_tokens, hidden)
        residual = self.model.embed_tokens(input_ids)  # a fresh tensor: the residual stream, updated in place
        if self.model.embed_scale is not None:
            # A float32 scalar cast to the model dtype, as transformers' scaled embedding does.
            residual.mul_(torch.tensor(self.model.embed_scale, dtype=torch.float32).to(residual.dtype))
        # The one place that chooses: a small decode step runs every layer in one C call
        # (pdserve/engine/models/fused_decode.py), bit for bit the layer-by-layer path below.
        if self.fused_decoder is not None and self.fused_decoder.serves(residual.shape[0], attn_metadata):
            return self.fused_decoder(residual, positions, kv_caches, attn_metadata)
        rope = self.model.rotary.tables(positions, residual.dtype)  # once per step, shared by every layer
        local_rope = None if self.model.rotary_local is None else self.model.rotary_local.tables(positions, residual.dtype)
        delta = None
        between = self.between_layers
        # A paged pool's layer groups read different pages: each layer its own metadata.
        per_layer = attn_metadata if isinstance(attn_metadata, LayerMetadata) else None
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if index and between is not None:
                between()
            layer_rope = local_rope if layer.local_rope else rope
            metadata = attn_metadata if per_layer is None else per_layer[index]
            delta = layer(residual, delta, layer_rope, kv_cache, backend, metadata)
        return self.model.norm(residual, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Only the rows that are sampled reach here: (num_sampled, hidden) -> (num_sampled, vocab)
        return self.cap_logits(self.lm_head_packed(hidden))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-cap, cap * tanh(logits / cap), as transformers computes it (else unchanged)."""
        cap = self.model.final_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


def sliding_windows(config: Any) -> list[int | None]:
    """Each layer's attention window as the checkpoint's config defines it (None: full attention).

    transformers 5 configs list ``layer_types`` ("sliding_attention" / "full_attention") beside
    ``sliding_window``; a config without them slides every layer when ``sliding_window`` is set (and, for
    Qwen's, ``use_sliding_window`` is not False)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [int(window) if kind == "sliding_attention" else None for kind in layer_types]
    return [int(window)] * config.num_hidden_layers
