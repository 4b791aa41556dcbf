"""Which part of the model each tensor-parallel rank owns, and slicing a loaded model to it.

Megatron-style, as vLLM does: q/k/v and gate/up are column-parallel (a rank keeps
the output rows of its heads / its MLP columns), o and down are row-parallel (a
rank keeps the matching input columns; the partial outputs are summed by one
all-reduce after each, and their biases are added once, on rank 0). The LM
head is split by vocabulary for the rows a decode step samples, rank 0 keeping
the rest for steps with many rows; the embedding lookup is replicated
(``vocab_head``).

KV heads: with ``tp <= num_kv_heads`` each rank owns ``num_kv_heads / tp`` of
them; with more ranks than KV heads each KV head is replicated on the
``tp / num_kv_heads`` ranks whose query heads read it. The same rule places KV
heads on both sides of a handoff (``kv_heads_of_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.engine.parallel.vocab_head import shard_lm_head


def check_tensor_parallel(hf_config: Any, tensor_parallel_size: int) -> None:
    """ValueError naming ``tensor_parallel_size`` unless the model splits over that many ranks (vLLM's rules)."""
    tp = tensor_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return
    from pdserve.engine.models import model_class

    reason = model_class(hf_config).tensor_parallel_reason
    if reason is not None:
        raise ValueError(f"tensor_parallel_size={tp} cannot serve this model: {reason}; use tensor_parallel_size=1")
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    intermediate = int(hf_config.intermediate_size)
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's num_attention_heads ({heads})")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's num_key_value_heads ({kv_heads}) or be a multiple of it"
        )
    if intermediate % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's intermediate_size ({intermediate})")
    expert_width = getattr(hf_config, "moe_intermediate_size", None)
    if expert_width and int(expert_width) % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's moe_intermediate_size ({expert_width})"
        )
    if int(hf_config.vocab_size) < tp:
        raise ValueError(f"tensor_parallel_size={tp} must not exceed the model's vocab_size ({hf_config.vocab_size})")


def kv_heads_of_rank(num_kv_heads: int, tensor_parallel_size: int, rank: int) -> range:
    """The (global) KV heads rank ``rank`` of ``tensor_parallel_size`` keeps in its pool."""
    tp = tensor_parallel_size
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    if tp <= num_kv_heads:
        per_rank = num_kv_heads // tp
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class TensorParallelShard:
    """Rank ``rank`` of ``world_size``: the slices of the model it keeps."""

    rank: int
    world_size: int

    def shard(self, model: nn.Module) -> None:
        """Slice a loaded, not yet packed ``LlamaForCausalLM`` in place to this rank's part.

        Sets each attention's local head counts and each MLP's local width, so
        the model code runs unchanged on its shard, and keeps this rank's part of
        the LM head (rank 0: all of it, in two parts; ``vocab_head``).
        """
        if self.world_size == 1:
            return
        rank, tp = self.rank, self.world_size
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                if getattr(attn, "kv_parts", 2) == 1:
                    _shard_latent_attention(attn, rank, tp)
                else:
                    _shard_attention(attn, rank, tp)
                # A mixture of experts splits each expert as an MLP (vLLM's TP); the router stays whole.
                for mlp in layer.mlp.mlps() if hasattr(layer.mlp, "mlps") else [layer.mlp]:
                    width = mlp.intermediate_size // tp
                    _keep_rows(mlp.gate_proj, rank * width, (rank + 1) * width)
                    _keep_rows(mlp.up_proj, rank * width, (rank + 1) * width)
                    _keep_columns(mlp.down_proj, rank * width, (rank + 1) * width, rank == 0)
                    mlp.intermediate_size = width
            shard_lm_head(model, rank, tp)


def _shard_attention(attn: nn.Module, rank: int, tp: int) -> None:
    """This rank's query heads (q and o) and the KV heads they read (k and v; replicated where tp > KV heads)."""
    head_dim = attn.head_dim
    heads = attn.num_heads // tp
    kv = kv_heads_of_rank(attn.num_kv_heads, tp, rank)
    _keep_rows(attn.q_proj, rank * heads * head_dim, (rank + 1) * heads * head_dim)
    _keep_rows(attn.k_proj, kv.start * head_dim, kv.stop * head_dim)
    _keep_rows(attn.v_proj, kv.start * head_dim, kv.stop * head_dim)
    _keep_columns(attn.o_proj, rank * heads * head_dim, (rank + 1) * heads * head_dim, rank == 0)
    attn.num_heads, attn.num_kv_heads = heads, len(kv)


def _shard_latent_attention(attn: nn.Module, rank: int, tp: int) -> None:
    """Latent attention (models/deepseek.py): this rank's query heads (q or q_b, their blocks of kv_b, and o's
    columns); the latent projections stay whole, and every rank caches the whole latent, the one KV head
    (``kv_heads_of_rank`` replicates it)."""
    heads = attn.num_heads // tp
    qk = attn.nope_dim + attn.rope_head_dim
    q = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    _keep_rows(q, rank * heads * qk, (rank + 1) * heads * qk)
    kv_b = attn.nope_dim + attn.v_head_dim
    _keep_rows(attn.kv_b_proj, rank * heads * kv_b, (rank + 1) * heads * kv_b)
    v = attn.v_head_dim
    _keep_columns(attn.o_proj, rank * heads * v, (rank + 1) * heads * v, rank == 0)
    attn.num_heads = heads


def _keep_rows(linear: nn.Linear, start: int, stop: int) -> None:
    """Column-parallel: keep output features [start, stop) (weight rows and bias entries)."""
    linear.weight = nn.Parameter(linear.weight.detach()[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def _keep_columns(linear: nn.Linear, start: int, stop: int, keep_bias: bool) -> None:
    """Row-parallel: keep input features [start, stop); the bias only where it is added (one rank)."""
    linear.weight = nn.Parameter(linear.weight.detach()[:, start:stop].contiguous(), requires_grad=False)
    if linear.bias is not None and not keep_bias:
        linear.bias = None
    linear.in_features = stop - start


class AllReduceOutput(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks (one all-reduce)."""

    def __init__(self, projection: nn.Module, all_reduce: Any) -> None:
        super().__init__()
        self.projection = projection
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (num_tokens, in / tp) -> (num_tokens, out)
        out = self.projection(x)
        self.all_reduce(out)
        return out


def install_all_reduce(model: nn.Module, all_reduce: Any) -> None:
    """Wrap every packed row-parallel projection (o, down) so its output is all-reduced in place."""
    # The fused decode step calls the projections' kernels directly, with no all-reduce between them.
    model.fused_decoder = None
    for layer in model.model.layers:
        layer.self_attn.o_proj = AllReduceOutput(layer.self_attn.o_proj, all_reduce)
        if hasattr(layer.mlp, "experts"):
            # Every rank routes alike (the router and its input are whole): one all-reduce of the weighted
            # sum of the experts' partial outputs.
            layer.mlp = AllReduceOutput(layer.mlp, all_reduce)
        else:
            layer.mlp.down_proj = AllReduceOutput(layer.mlp.down_proj, all_reduce)
