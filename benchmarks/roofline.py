"""How close pdserve's measured times come to what the machine's limits allow for this workload.

Two lower bounds, from ``MachineLimits``: the whole run cannot finish faster than
its FLOPs at the best matmul rate, and one decode step cannot finish faster than
reading the weights and the batch's KV cache once at the best memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.machine_limits import MachineLimits
from benchmarks.workload import RunResult, Workload


@dataclass(frozen=True)
class ModelCost:
    """The figures of a decoder-only model that set its FLOPs and its bytes read per step."""

    # Every matrix a token's forward pass multiplies by; the embedding table only
    # contributes a row lookup, but the LM head multiplies, so a tied matrix counts once.
    non_embedding_params: int
    lm_head_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Bytes per stored weight and per stored KV element, scales included: 4 in
    # float32, 2 in bf16, about 1 and 0.5 plus scales for int8 and int4.
    weight_bytes_per_value: float = 4
    kv_bytes_per_value: float = 4

    @property
    def compute_params(self) -> int:
        return self.non_embedding_params + self.lm_head_params

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward step reads: every matrix it multiplies by, once."""
        return round(self.compute_params * self.weight_bytes_per_value)

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer.
        return round(self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value)

    def attention_flops(self, num_queries: int, context_len: int) -> int:
        """Q·Kᵀ and P·V for ``num_queries`` tokens attending to ``context_len`` positions, all layers."""
        return self.num_layers * 4 * self.num_heads * self.head_dim * num_queries * context_len


def model_cost(model: Any, weight_bytes_per_value: float = 4, kv_bytes_per_value: float = 4) -> ModelCost:
    """Read from a loaded transformers model; ``parameters()`` yields a tied matrix once."""
    config = model.config
    embedding = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    untied_lm_head = 0 if lm_head is embedding else lm_head.numel()
    return ModelCost(
        non_embedding_params=total - embedding.numel() - untied_lm_head,
        lm_head_params=lm_head.numel(),
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        weight_bytes_per_value=weight_bytes_per_value,
        kv_bytes_per_value=kv_bytes_per_value,
    )


def whole_run_bound(cost: ModelCost, workload: Workload, limits: MachineLimits, measured: RunResult) -> dict[str, Any]:
    """FLOPs ≈ 2 × params × (prompt + output tokens), against the best matmul rate."""
    num_output_tokens = len(workload.prompts) * workload.output_len
    flops = 2 * cost.compute_params * (workload.num_prompt_tokens + num_output_tokens)
    # The estimate above runs the LM head over every prompt token and leaves attention out.
    # This one counts what a forward pass must do: the LM head only where a token is
    # sampled, no forward for the last sampled token, and causal attention over the context.
    exact_flops = 0
    for prompt in workload.prompts:
        prompt_len = len(prompt)
        forward_tokens = prompt_len + workload.output_len - 1
        exact_flops += 2 * cost.non_embedding_params * forward_tokens
        exact_flops += 2 * cost.lm_head_params * workload.output_len
        # Token i (0-based) attends to i + 1 positions.
        exact_flops += cost.attention_flops(1, forward_tokens * (forward_tokens + 1) // 2)
    bound_s = flops / (limits.best_gflops * 1e9)
    exact_bound_s = exact_flops / (limits.best_gflops * 1e9)
    return {
        "compute_params": cost.compute_params,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": num_output_tokens,
        "flops": flops,
        "compute_bound_s": bound_s,
        "measured_s": measured.wall_s,
        "fraction_of_bound": bound_s / measured.wall_s,
        "exact_flops": exact_flops,
        "exact_compute_bound_s": exact_bound_s,
        "exact_fraction_of_bound": exact_bound_s / measured.wall_s,
    }


def prefill_bound(cost: ModelCost, workload: Workload, limits: MachineLimits, measured: RunResult) -> dict[str, Any]:
    """The prefill-only pass (one output token per prompt) against its FLOPs at the best matmul rate."""
    flops = 0
    for prompt in workload.prompts:
        flops += 2 * cost.non_embedding_params * len(prompt) + 2 * cost.lm_head_params
        flops += cost.attention_flops(1, len(prompt) * (len(prompt) + 1) // 2)
    bound_s = flops / (limits.best_gflops * 1e9)
    return {
        "flops": flops,
        "compute_bound_s": bound_s,
        "measured_s": measured.wall_s,
        "fraction_of_bound": bound_s / measured.wall_s,
    }


def decode_step_bound(
    cost: ModelCost,
    workload: Workload,
    limits: MachineLimits,
    batch_size: int,
    full: RunResult,
    prefill_only: RunResult,
    gflops: float | None = None,
) -> dict[str, Any]:
    """One decode step at ``batch_size`` and the mean decode context, against bandwidth and matmul limits.

    The measured step is (full run − prefill-only run) / (output_len − 1): the
    prefill-only run produces the first output token, so the difference is the
    remaining output_len − 1 steps. ``gflops`` is the matmul rate of the setting's
    compute dtype; None: the machine's best float32 rate.
    """
    # Step j (1 .. output_len-1) feeds the token sampled at step j-1 at context prompt_len + j;
    # the mean of prompt_len + j over those steps is mean_prompt_len + output_len / 2.
    mean_context = workload.mean_prompt_len + workload.output_len / 2
    measured_s = (full.wall_s - prefill_only.wall_s) / (workload.output_len - 1)
    return step_bound(cost, limits, batch_size, mean_context, measured_s, gflops)


def step_bound(
    cost: ModelCost,
    limits: MachineLimits,
    batch_size: int,
    mean_context: float,
    measured_s: float,
    gflops: float | None = None,
) -> dict[str, Any]:
    """One decode step of ``batch_size`` sequences at ``mean_context`` tokens, measured in ``measured_s``.

    The bound is the larger of reading the weights and the batch's KV once at the
    best bandwidth and the step's FLOPs at ``gflops`` (None: the best float32 rate).
    """
    kv_bytes = batch_size * mean_context * cost.kv_bytes_per_token
    memory_bound_s = (cost.weight_bytes + kv_bytes) / (limits.best_gbps * 1e9)
    step_flops = 2 * cost.compute_params * batch_size + cost.attention_flops(batch_size, round(mean_context))
    compute_bound_s = step_flops / ((gflops or limits.best_gflops) * 1e9)
    return {
        "batch_size": batch_size,
        "mean_context_len": mean_context,
        "weight_bytes": cost.weight_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
        "kv_bytes": kv_bytes,
        "memory_bound_s": memory_bound_s,
        "flops": step_flops,
        "compute_bound_s": compute_bound_s,
        "roofline_bound_s": max(memory_bound_s, compute_bound_s),
        "measured_step_s": measured_s,
        "fraction_of_memory_bound": memory_bound_s / measured_s,
        "fraction_of_roofline_bound": max(memory_bound_s, compute_bound_s) / measured_s,
    }
