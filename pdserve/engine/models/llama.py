"""Llama-family decoder over a flattened token batch and a paged KV cache, and the families built from it.

The building blocks (attention with optional q/k norms and partial rotary, the
gated MLP, pre- or post-norm decoder layers) serve Llama, SmolLM, Mistral,
Qwen2, Qwen3 and OLMo 2; each family is a short class that picks its options
(``models/__init__.py`` maps a checkpoint's ``architectures`` to them).
Parameter names match Hugging Face's classes so checkpoints load by name. After loading, ``pack_weights(method)`` fuses the
projections that share an input (q/k/v, gate/up) into one ``PackedLinear`` each,
whose linear method (pdserve/engine/layers/linear.py) decides how the matrix is kept
and multiplied: float32 in MKL's packed GEMM format on CPU (about three times
faster than ``F.linear`` at decode batch sizes, BENCHMARKS.md), bf16, INT8 or
INT4. Every forward works on the tokens of one engine step flattened into a
single dimension: no padding, no batch dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.layers.fused_ops import FusedOps, load_fused_ops
from pdserve.engine.layers.linear import LinearMethod, PackedLinear, UnquantizedLinearMethod
from pdserve.engine.models.fused_decode import FusedDecoder, build_fused_decoder
from pdserve.engine.models.rope import RotaryEmbedding, apply_rotary

_ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu}


class RMSNorm(nn.Module):
    """RMSNorm of the residual stream, after adding the previous sublayer's output into it (``delta``)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
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
        # Normalise in float32 whatever the model dtype, as the reference does.
        dtype = residual.dtype
        x32 = residual.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in float32 whatever x's dtype (the q/k norms of Qwen3 and OLMo 2)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class PlainRMSNorm(nn.Module):
    """An RMSNorm with only a weight (``rms_norm``), for the q/k norms."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# Where a family normalises queries and keys before the rotation: per head over head_dim (Qwen3), or over
# every head of the projection at once (OLMo 2).
QK_NORMS = (None, "head", "all_heads")


class Attention(nn.Module):
    def __init__(
        self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: str | None = None, window: int | None = None
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
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm = PlainRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = PlainRMSNorm(self.head_dim, config.rms_norm_eps)
        elif qk_norm == "all_heads":
            self.q_norm = PlainRMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
            self.k_norm = PlainRMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps)

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
        if self.window is None:
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (n, heads, head_dim)
        else:
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata, window=self.window)
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
    def __init__(self, config: Any, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.intermediate_size = config.intermediate_size
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


@dataclass(frozen=True)
class FamilyOptions:
    """What a family changes in the shared decoder."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str | None = None  # one of QK_NORMS
    # "pre": norm before each sublayer (Llama); "post": norm of each sublayer's output before it joins the
    # residual, none before (OLMo 2).
    norm_placement: str = "pre"


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, options: FamilyOptions, window: int | None = None) -> None:
        super().__init__()
        self.post_norms = options.norm_placement == "post"
        if self.post_norms:
            self.post_feedforward_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_attention_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)
        else:
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, options.qkv_bias, options.o_bias, options.qk_norm, window)
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
            # Each sublayer reads the residual itself; its output is normalised, then added.
            if delta is not None:
                residual.add_(delta)
            attn_out = self.self_attn(residual, rope, kv_cache, backend, attn_metadata)
            residual.add_(self.post_attention_layernorm(attn_out))
            return self.post_feedforward_layernorm(self.mlp(residual))
        # Each sublayer's output is added into the residual by the norm after it (fused on CPU in bf16).
        attn_out = self.self_attn(self.input_layernorm(residual, delta), rope, kv_cache, backend, attn_metadata)
        return self.mlp(self.post_attention_layernorm(residual, attn_out))


class DecoderModel(nn.Module):
    def __init__(self, config: Any, max_positions: int, options: FamilyOptions) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # A window no sequence outgrows (max_positions) changes nothing: those layers attend to everything.
        windows = [w if w is not None and w < max_positions else None for w in sliding_windows(config)]
        self.layers = nn.ModuleList(DecoderLayer(config, options, window) for window in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)


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
        if any(layer.self_attn.window is not None for layer in self.model.layers) or (
            self.model.rotary.cos.shape[-1] != attention.head_dim
        ):
            # The fused C step attends to the whole context and rotates every feature of a head.
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
                if layer.mlp.act is nn.functional.silu:
                    layer.mlp.fused = fused
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
        return self.model.layers[0].self_attn.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:  # (num_tokens, hidden)
        residual = self.model.embed_tokens(input_ids)  # a fresh tensor: the residual stream, updated in place
        # The one place that chooses: a small decode step runs every layer in one C call
        # (pdserve/engine/models/fused_decode.py), bit for bit the layer-by-layer path below.
        if self.fused_decoder is not None and self.fused_decoder.serves(residual.shape[0], attn_metadata):
            return self.fused_decoder(residual, positions, kv_caches, attn_metadata)
        rope = self.model.rotary.tables(positions, residual.dtype)  # once per step, shared by every layer
        delta = None
        between = self.between_layers
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if index and between is not None:
                between()
            delta = layer(residual, delta, rope, kv_cache, backend, attn_metadata)
        return self.model.norm(residual, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Only the rows that are sampled reach here: (num_sampled, hidden) -> (num_sampled, vocab)
        return self.lm_head_packed(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layout, every layer with the config's ``sliding_window`` when it sets one."""

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        return FamilyOptions()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on q/k/v (not on o), usually tied embeddings."""

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        return FamilyOptions(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: an RMSNorm over each head of q and k before the rotation, an explicit head_dim, optional
    q/k/v/o biases (``attention_bias``)."""

    fused_decode_layout = False

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return FamilyOptions(qkv_bias=bias, o_bias=bias, qk_norm="head")


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2: RMSNorm over all heads of q and of k, and norms after each sublayer instead of before."""

    fused_decode_layout = False
    tensor_parallel_reason = "OLMo 2 normalises q and k over all heads at once, which tensor parallelism splits"

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return FamilyOptions(qkv_bias=bias, o_bias=bias, qk_norm="all_heads", norm_placement="post")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4 mini: Llama's layout, with q/k/v and gate/up fused in the checkpoint (split at load),
    LongRoPE scaling, a ``partial_rotary_factor`` (Phi-4 mini) and an optional ``sliding_window``."""

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        return FamilyOptions()

    def checkpoint_parts(self, key: str) -> list[tuple[str, tuple[int, int]]] | None:
        """The parameters a fused checkpoint tensor fills, by rows (model_loader.load_weights)."""
        prefix, _, name = key.rpartition(".")
        if prefix.endswith(".self_attn.qkv_proj") and name in ("weight", "bias"):
            attention = self.model.layers[0].self_attn
            q = attention.num_heads * attention.head_dim
            kv = attention.num_kv_heads * attention.head_dim
            base = prefix.removesuffix("qkv_proj")
            return [(f"{base}q_proj.{name}", (0, q)), (f"{base}k_proj.{name}", (q, q + kv)),
                    (f"{base}v_proj.{name}", (q + kv, q + 2 * kv))]
        if prefix.endswith(".mlp.gate_up_proj") and name in ("weight", "bias"):
            intermediate = self.config.intermediate_size
            base = prefix.removesuffix("gate_up_proj")
            return [(f"{base}gate_proj.{name}", (0, intermediate)),
                    (f"{base}up_proj.{name}", (intermediate, 2 * intermediate))]
        return None


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
