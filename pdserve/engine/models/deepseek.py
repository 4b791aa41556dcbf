"""DeepSeek-V2 and V3: multi-head latent attention (MLA) over Llama's decoder, with shared plus routed experts.

MLA compresses each token's keys and values into one latent of ``kv_lora_rank``
features (normalised), beside a small ``qk_rope_head_dim`` part that carries the
position (rotated, shared by every head). The paged cache keeps exactly that row per
token and layer (``kv_parts`` 1: no separate values, one "KV head"), where
multi-head attention would keep every head's key and value.

Attention is computed in the two forms vLLM and SGLang use:

- **absorbed** (decode, and the short chunks a speculative step verifies): each
  head's query is carried into the latent space through that head's slice of
  ``kv_b_proj`` (q_nope @ W_UK), so scores are dot products with the cached rows
  themselves, and the output comes back out through W_UV. This is multi-query
  attention with one KV head of ``kv_lora_rank + qk_rope_head_dim`` features, the
  rows read in place by the paged kernel;
- **expanded** (prefill chunks): the context's latents are expanded by ``kv_b_proj``
  into per-head keys and values and attended like ordinary multi-head attention,
  which costs fewer multiply-adds when queries are many.

Both equal transformers' computation up to float rounding (the absorbed form
reassociates W_UK's product).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.layers.linear import LinearMethod, PackedLinear
from pdserve.engine.models.llama import FamilyOptions, LlamaForCausalLM, MoEOptions, PlainRMSNorm
from pdserve.engine.models.rope import apply_rotary, apply_rotary_interleaved, rope_parameters, yarn_softmax_scale

# transformers' DeepSeek RMSNorms on the q and kv latents keep their default epsilon, not the config's.
_LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention; parameter names as transformers' ``DeepseekV2Attention``."""

    # One cached row per token and layer (engine.types.handoff.KV_PARTS).
    kv_parts = 1

    def __init__(self, config: Any, interleaved_rope: bool) -> None:
        super().__init__()
        if getattr(config, "sliding_window", None):
            raise ValueError("sliding_window is not served with latent attention")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = 1  # the latent, shared by every head
        self.nope_dim = config.qk_nope_head_dim
        self.rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        self.head_dim = self.latent_dim + self.rope_head_dim  # one cached row
        self.q_lora_rank = config.q_lora_rank
        qk_head_dim = self.nope_dim + self.rope_head_dim
        hidden, heads, bias = config.hidden_size, self.num_heads, bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = PlainRMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent_dim + self.rope_head_dim, bias=bias)
        self.kv_a_layernorm = PlainRMSNorm(self.latent_dim, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.latent_dim, heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, hidden, bias=bias)
        self.scale = yarn_softmax_scale(rope_parameters(config), qk_head_dim**-0.5)
        # V2 rotates adjacent pairs (complex products), V3 where ``rope_interleave`` (its default).
        self.rotate = apply_rotary_interleaved if interleaved_rope else apply_rotary
        self.window = None  # no sliding window (DecoderModel reads it)

    def pack_weights(self, method: LinearMethod) -> None:
        # The projections of the hidden state (q or q's latent, and the kv latent) in one GEMM.
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        self.q_width = first.out_features
        self.input_proj = PackedLinear([first, self.kv_a_proj_with_mqa], method)
        if self.q_lora_rank is not None:
            self.q_b_proj = PackedLinear([self.q_b_proj], method)
            del self.q_a_proj
        else:
            del self.q_proj
        del self.kv_a_proj_with_mqa
        self.o_proj = PackedLinear([self.o_proj], method)
        # kv_b_proj stays a float matrix: the absorbed form uses its per-head blocks, the expanded one all of it.
        kv_b = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope_dim + self.v_head_dim, self.latent_dim)
        self.w_uk = kv_b[:, : self.nope_dim].contiguous()  # (heads, nope_dim, latent_dim)
        self.w_uv_t = kv_b[:, self.nope_dim :].transpose(1, 2).contiguous()  # (heads, latent_dim, v_head_dim)

    def forward(
        self,
        hidden: torch.Tensor,  # (num_tokens, hidden)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: (num_tokens, 1, rope_head_dim) each
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # the latent rows, given as both
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        n, heads = hidden.shape[0], self.num_heads
        projected = self.input_proj(hidden)  # (n, q_width + latent_dim + rope_head_dim)
        q = projected[:, : self.q_width]
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(n, heads, self.nope_dim + self.rope_head_dim)
        kv = projected[:, self.q_width :]
        latent = torch.empty(n, 1, self.head_dim, dtype=hidden.dtype, device=hidden.device)
        latent[:, 0, : self.latent_dim] = self.kv_a_layernorm(kv[:, : self.latent_dim])
        latent[:, :, self.latent_dim :] = self.rotate(kv[:, None, self.latent_dim :], *rope)
        q_rope = self.rotate(q[..., self.nope_dim :], *rope)  # (n, heads, rope_head_dim)
        out = backend.forward_latent(q[..., : self.nope_dim], q_rope, latent, kv_cache[0], attn_metadata, self)
        return self.o_proj(out.reshape(n, heads * self.v_head_dim))

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """Queries' no-rope parts carried into the latent space: (n, heads, nope_dim) -> (n, heads, latent_dim)."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def unabsorb(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Attention output in the latent space back to each head's values: (n, heads, latent_dim) ->
        (n, heads, v_head_dim)."""
        return torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows (ctx, latent_dim + rope_head_dim) as per-head keys (ctx, heads, nope_dim + rope_head_dim)
        and values (ctx, heads, v_head_dim), as transformers' ``expand_kv`` builds them."""
        ctx = latent.shape[0]
        kv = nn.functional.linear(latent[:, : self.latent_dim], self.kv_b_proj.weight)
        kv = kv.view(ctx, self.num_heads, self.nope_dim + self.v_head_dim)
        keys = torch.empty(ctx, self.num_heads, self.nope_dim + self.rope_head_dim, dtype=kv.dtype, device=kv.device)
        keys[..., : self.nope_dim] = kv[..., : self.nope_dim]
        keys[..., self.nope_dim :] = latent[:, None, self.latent_dim :]
        return keys, kv[..., self.nope_dim :]


def _deepseek_moe(config: Any, v3: bool) -> tuple[MoEOptions | None, tuple[int, ...]]:
    """The routed layers (from ``first_k_dense_replace`` on, as transformers builds them) and their routing."""
    num_experts = int(getattr(config, "n_routed_experts", 0) or 0)
    if not num_experts:
        return None, ()
    if v3:
        scoring, group_limit = "sigmoid", "top2_sum"
        normalise = bool(getattr(config, "norm_topk_prob", True))
    else:
        method = getattr(config, "topk_method", "greedy") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r} is not supported (supported: 'greedy', 'group_limited_greedy')")
        scoring, group_limit = "softmax", ("max" if method == "group_limited_greedy" else None)
        normalise = False  # transformers' V2 router never renormalises
    options = MoEOptions(
        num_experts=num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        normalise=normalise,
        weights_in_model_dtype=False,
        scoring=scoring,
        group_limit=group_limit,
        num_groups=int(config.n_group or 1) if group_limit else 1,
        topk_groups=int(config.topk_group or 1) if group_limit else 1,
        normalise_eps=1e-20 if v3 else 0.0,
        routed_scale=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
        shared_intermediate_size=config.moe_intermediate_size * int(getattr(config, "n_shared_experts", 0) or 0),
        router_in_float32=True,
    )
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    return options, tuple(range(first_dense, config.num_hidden_layers))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (and V2-Lite): latent attention, optional q compression (``q_lora_rank``), softmax routing
    (greedy or group-limited), shared experts, the first ``first_k_dense_replace`` layers dense."""

    fused_decode_layout = False
    deepseek_v3 = False

    @classmethod
    def family_options(cls, config: Any) -> FamilyOptions:
        interleaved = True if not cls.deepseek_v3 else bool(getattr(config, "rope_interleave", True))
        moe, moe_layers = _deepseek_moe(config, cls.deepseek_v3)
        return FamilyOptions(
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            moe=moe,
            moe_layers=moe_layers,
            attention=lambda hf_config: LatentAttention(hf_config, interleaved),
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (and R1): V2's layout with sigmoid routing, a learnt correction bias on expert choice, groups
    scored by their best two experts, renormalised weights (``norm_topk_prob``)."""

    deepseek_v3 = True
