"""Llama-family decoder (Llama, SmolLM, Qwen2) over a flattened token batch and a paged KV cache.

Parameter names match Hugging Face's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``
so checkpoints load by name. After loading, ``pack_weights(method)`` fuses the
projections that share an input (q/k/v, gate/up) into one ``PackedLinear`` each,
whose linear method (pdserve/engine/layers/linear.py) decides how the matrix is kept
and multiplied: float32 in MKL's packed GEMM format on CPU (about three times
faster than ``F.linear`` at decode batch sizes, BENCHMARKS.md), bf16, INT8 or
INT4. Every forward works on the tokens of one engine step flattened into a
single dimension: no padding, no batch dimension.
"""

from __future__ import annotations

from collections.abc import Callable
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


class Attention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)

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
        # Queries and keys are adjacent columns, so one rotation covers both.
        qk = apply_rotary(qkv[:, : heads + kv_heads], *rope)  # (n, heads + kv_heads, head_dim)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, heads + kv_heads :]  # (n, kv_heads, head_dim)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (n, heads, head_dim)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


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


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, qkv_bias, o_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, mlp_bias)

    def forward(
        self,
        residual: torch.Tensor,  # (num_tokens, hidden): the residual stream, updated in place
        delta: torch.Tensor | None,  # the previous layer's MLP output, not yet added (None before layer 0)
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:  # this layer's MLP output, for the next norm to add
        # Each sublayer's output is added into the residual by the norm after it (fused on CPU in bf16).
        attn_out = self.self_attn(self.input_layernorm(residual, delta), rope, kv_cache, backend, attn_metadata)
        return self.mlp(self.post_attention_layernorm(residual, attn_out))


class DecoderModel(nn.Module):
    def __init__(self, config: Any, max_positions: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, o_bias, mlp_bias) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)


class LlamaForCausalLM(nn.Module):
    """Llama family: GQA, RoPE (default or llama3 scaling), tied or untied embeddings."""

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self._build(config, max_positions, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def _build(self, config: Any, max_positions: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> None:
        self.config = config
        # Set by pack_weights; None: every step runs layer by layer.
        self.fused_decoder: FusedDecoder | None = None
        # Called between two layers of a layer-by-layer step (LLMEngine.between_layers).
        self.between_layers: Callable[[], None] | None = None
        self.model = DecoderModel(config, max_positions, qkv_bias, o_bias, mlp_bias)
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
                layer.input_layernorm.fused = layer.post_attention_layernorm.fused = fused
                if layer.mlp.act is nn.functional.silu:
                    layer.mlp.fused = fused
            self.model.norm.fused = fused
        # Decode steps in one C call where the model's layout allows (None elsewhere; see forward).
        self.fused_decoder = build_fused_decoder(self)

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


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on q/k/v (not on o), usually tied embeddings."""

    def __init__(self, config: Any, max_positions: int) -> None:
        nn.Module.__init__(self)
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 checkpoints with use_sliding_window=True are not supported")
        self._build(config, max_positions, qkv_bias=True, o_bias=False, mlp_bias=False)
