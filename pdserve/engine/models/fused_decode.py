"""A decode step through every decoder layer in one C call (``pdserve/engine/kernels/fused_decode.c``).

At batch 1 a layer's arithmetic is a few hundred microseconds, and the Python
and torch dispatch around its ten kernel calls (plus eight small torch ops of
rotary) cost about as much again: llama.cpp runs a token as one graph of C ops.
``FusedDecoder`` collects every layer's weight pointers (INT8/INT4 tiles,
scales, biases, norm weights) once, when the model is packed, into an array of
the C structs (laid out by numpy structured dtypes, checked against the C side's
sizes), and the KV pool's pointers when it first sees the pool; a step
then passes only its own inputs (embeddings, positions, slots and the attention
kernel's plan). The C side calls the very kernels the unfused path calls, in the
same order and with the same rounding, so hidden states are bit for bit the
unfused bfloat16 path's (tests/unit/test_fused_decode.py).

It serves bfloat16 models on CPU whose projections all run pdserve's C
kernels: INT8/INT4, or unquantized bf16 on a CPU with AVX512-BF16 and no AMX
(pdserve/engine/layers/dense_kernels.py), with SiLU MLPs, for steps whose every token the paged
attention kernel attends (decodes, and the short chunks a speculative step
verifies) and of at most ``FUSED_DECODE_MAX_ROWS`` tokens. Everything else —
float32 (the exactness oracle), GPU, bf16 weights oneDNN serves, tensor parallelism,
a package built without its kernels, prefill chunks, larger batches, forward hooks on the decoder
layers (the KV pusher's), ``enforce_eager=True`` — runs the
model's layer-by-layer forward; ``LlamaForCausalLM.forward`` is the one place
that chooses.

With LoRA adapters (pdserve/engine/layers/lora.py's ``install`` calls ``add_lora``), every projection's
struct also points at its ``LoRALinear``'s slots, and a step whose rows have adapters passes them
(``LoRARows``): the C side adds each row's update after each projection with the same kernel as the
wrappers, so adapter steps stay fused and bit for bit the layer-by-layer path's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pdserve.engine.attention.sdpa import SdpaMetadata
from pdserve.engine.kv.cache import QuantizedKV
from pdserve.engine.layers.linear import Int4LinearMethod, Int8LinearMethod, PackedLinear, UnquantizedLinearMethod
from pdserve.engine.layers.quant_kernels import _PARALLEL_MIN_BYTES
from pdserve.engine.native import KernelOps, load_kernel_ops

if TYPE_CHECKING:
    from pdserve.engine.layers.lora import LoRALinear, LoRAState

logger = logging.getLogger(__name__)

# Steps of up to this many tokens take the fused path. One thread, the default model, INT4: the fused step
# took 0.56x the layer-by-layer step's time at 1 row, 0.73x at 8, 0.94x at 32 and 1.04x at 128 (min; 0.86x
# by the medians), on a Zen 4: benchmarks/decode_step.py, BENCHMARKS.md. It can go no further than the projections' own
# kernels (their kernel_max_rows: 256 on CPUs with AMX or without VNNI): above those the layer-by-layer path
# dequantizes to bf16.
FUSED_DECODE_MAX_ROWS = 32
# The attention kernel's limit (paged_attention.c's MAX_HEAD_DIM) and the quantized tiles' column block.
_MAX_HEAD_DIM = 256
_QBLOCK = 32
_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_INT8, _INT4, _BF16 = 1, 2, 3
_STATUS_ERRORS = {
    -1: "the fused decode step could not allocate its scratch memory",
    -2: "the fused decode step was given attention it cannot serve (a query longer than its context?)",
    -3: "slot_mapping must lie in the KV pool's slots; nothing was written",
    -4: "positions must lie in [0, the rotary tables' length); nothing was written",
}


# The C structs of fused_decode.c, field for field (aligned as C aligns them; the sizes are checked against
# the C side's when the step is built). Pointers are addresses, 0 for NULL.
_POINTER = np.uintp
_PROJECTION = np.dtype([
    ("kind", np.int64), ("qweight", _POINTER), ("scales", _POINTER), ("minimums", _POINTER),
    ("group_size", np.int64), ("bias", _POINTER), ("out_features", np.int64), ("in_features", np.int64),
    ("parallel", np.int64), ("lora_a", _POINTER), ("lora_b", _POINTER), ("lora_ranks", _POINTER),
    ("lora_columns", _POINTER), ("lora_modules", np.int64), ("lora_max_rank", np.int64),
    ("lora_weights_bf16", np.int64),
], align=True)
_LAYER = np.dtype([
    ("input_norm", _POINTER), ("post_norm", _POINTER), ("input_eps", np.float32), ("post_eps", np.float32),
    ("qkv", _PROJECTION), ("o", _PROJECTION), ("gate_up", _PROJECTION), ("down", _PROJECTION),
    ("key_cache", _POINTER), ("value_cache", _POINTER), ("key_scales", _POINTER), ("value_scales", _POINTER),
], align=True)
_MODEL = np.dtype([
    ("num_layers", np.int64), ("hidden", np.int64), ("heads", np.int64), ("kv_heads", np.int64),
    ("head_dim", np.int64), ("intermediate", np.int64), ("kv_kind", np.int64), ("block_size", np.int64),
    ("num_slots", np.int64), ("max_positions", np.int64), ("attn_scale", np.float32), ("final_eps", np.float32),
    ("cos", _POINTER), ("sin", _POINTER), ("final_norm", _POINTER), ("layers", _POINTER),
], align=True)
_LORA_ROWS = np.dtype([
    ("row_slots", _POINTER), ("row_scales", _POINTER), ("order", _POINTER), ("group_offsets", _POINTER),
    ("groups", np.int64),
], align=True)
# The layer struct's projections and the packed projections (LoRALinear's names) they are.
_PACKED = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


class FusedDecoder:
    """Every decoder layer of one model, and its final norm, as one C call per decode step.

    Holds the pointers of the model's weights (the model must outlive it, and its
    packed weights must not be replaced) and of the KV pool it last ran on.
    """

    def __init__(self, kernels: KernelOps, model: nn.Module, max_rows: int) -> None:
        self._ops, self._variant = kernels.ops, kernels.variant
        self.max_rows = max_rows
        decoder = model.model
        attn = decoder.layers[0].self_attn
        self._decoder_layers = list(decoder.layers)
        self._layers = np.zeros(len(decoder.layers), dtype=_LAYER)
        for struct, layer in zip(self._layers, decoder.layers):
            struct["input_norm"] = layer.input_layernorm.weight.data_ptr()
            struct["post_norm"] = layer.post_attention_layernorm.weight.data_ptr()
            struct["input_eps"] = layer.input_layernorm.eps
            struct["post_eps"] = layer.post_attention_layernorm.eps
            struct["qkv"] = _projection(layer.self_attn.qkv_proj)
            struct["o"] = _projection(layer.self_attn.o_proj)
            struct["gate_up"] = _projection(layer.mlp.gate_up_proj)
            struct["down"] = _projection(layer.mlp.down_proj)
        rotary = decoder.rotary
        self._model = np.zeros((), dtype=_MODEL)
        model_struct = self._model
        model_struct["num_layers"] = len(decoder.layers)
        model_struct["hidden"] = decoder.norm.weight.shape[0]
        model_struct["heads"] = attn.num_heads
        model_struct["kv_heads"] = attn.num_kv_heads
        model_struct["head_dim"] = attn.head_dim
        model_struct["intermediate"] = decoder.layers[0].mlp.intermediate_size
        model_struct["max_positions"] = rotary.cos.shape[0]
        # As the attention backend computes it (Python's double, then the kernel's float).
        model_struct["attn_scale"] = attn.head_dim**-0.5
        model_struct["final_eps"] = decoder.norm.eps
        model_struct["cos"] = rotary.cos.data_ptr()
        model_struct["sin"] = rotary.sin.data_ptr()
        model_struct["final_norm"] = decoder.norm.weight.data_ptr()
        model_struct["layers"] = self._layers.__array_interface__["data"][0]
        # The model struct's bytes, as the operator takes them (shares the array's memory).
        self._model_bytes = torch.from_numpy(self._model.reshape(1).view(np.uint8))
        self._hidden_size = int(model_struct["hidden"])
        self._pool_key: tuple[Any, ...] | None = None
        self._kv_caches: list[Any] | None = None
        self._lora_state: LoRAState | None = None

    def add_lora(self, layers: list[dict[str, LoRALinear]], state: LoRAState) -> None:
        """Each row's adapter update after every projection, from these wrappers' slots (per layer, packed name
        -> ``LoRALinear``, as ``install`` returns them), for the rows ``state`` holds in each step. The wrappers'
        buffers must outlive this decoder and keep their memory (``set_slot`` writes in place)."""
        if len(layers) != len(self._layers):
            raise ValueError(f"LoRA wrappers for {len(layers)} layers, the model has {len(self._layers)}")
        for index, wrapped in enumerate(layers):
            for field, packed in _PACKED.items():
                linear, struct = wrapped[packed], self._layers[field]
                shape = (int(struct["in_features"][index]), int(struct["out_features"][index]))
                if (linear.in_features, linear.out_features) != shape:
                    raise ValueError(f"layer {index} {packed}: the LoRA wrapper's (in, out) "
                                     f"{(linear.in_features, linear.out_features)} is not the projection's {shape}")
                if linear.lora_a.device.type != "cpu":
                    raise ValueError(f"layer {index} {packed}: the LoRA weights must be on the CPU")
                struct["lora_a"][index] = linear.lora_a.data_ptr()
                struct["lora_b"][index] = linear.lora_b.data_ptr()
                struct["lora_ranks"][index] = linear.ranks.data_ptr()
                struct["lora_columns"][index] = linear.columns.data_ptr()
                struct["lora_modules"][index] = len(linear.slices)
                struct["lora_max_rank"][index] = linear.max_rank
                struct["lora_weights_bf16"][index] = int(linear.lora_a.dtype == torch.bfloat16)
        self._lora_state = state

    def serves(self, num_tokens: int, attn_metadata: Any) -> bool:
        """Whether a step of ``num_tokens`` tokens with this attention metadata can run fused."""
        return (
            0 < num_tokens <= self.max_rows
            and isinstance(attn_metadata, SdpaMetadata)
            # Every token attended by the C kernel: no SDPA decodes, no prefill chunks.
            and attn_metadata.kernel_plan is not None
            and attn_metadata.num_decodes == 0
            and not attn_metadata.prefills
            # A hook on a decoder layer (pdserve/engine/kv/push.py's export of each layer's KV) must see every layer run.
            and not any(layer._forward_hooks or layer._forward_pre_hooks for layer in self._decoder_layers)
        )

    def __call__(
        self,
        residual: torch.Tensor,  # (num_tokens, hidden) bf16: the token embeddings, used as the residual stream
        positions: torch.Tensor,  # (num_tokens,) int64
        kv_caches: list[tuple[Any, Any]],
        attn_metadata: SdpaMetadata,
    ) -> torch.Tensor:  # (num_tokens, hidden) bf16: the final norm's output
        if kv_caches is not self._kv_caches:
            self._bind_pool(kv_caches)
        plan = attn_metadata.kernel_plan
        assert plan is not None
        slots = attn_metadata.slot_mapping
        for name, tensor in (("positions", positions), ("slot_mapping", slots)):
            if tensor.dtype != torch.long or not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU int64 tensor")
        if residual.dtype != torch.bfloat16 or not residual.is_contiguous() or residual.shape[1] != self._hidden_size:
            raise ValueError(f"the embeddings must be bfloat16 (num_tokens, {self._hidden_size}), got "
                             f"{residual.dtype} {tuple(residual.shape)}")
        rows = residual.shape[0]
        if positions.shape != (rows,) or slots.shape != (rows,):
            raise ValueError(f"positions and slot_mapping must hold one entry per token ({rows})")
        hidden = torch.empty_like(residual)
        status = self._ops.fused_decode(
            self._variant, self._model_bytes, self._lora_rows(rows), residual, hidden, positions, slots,
            plan.block_tables, plan.context_lens, plan.query_rows, plan.query_lens, plan.range_points,
            len(plan.item_ranges), plan.block_tables.shape[1], rows, torch.get_num_threads(),
        )
        if status != 0:
            error = MemoryError if status == -1 else ValueError
            raise error(_STATUS_ERRORS.get(status, f"the fused decode step failed ({status})"))
        return hidden

    def _lora_rows(self, rows: int) -> torch.Tensor | None:
        """The C struct of the step's rows under adapters, as bytes (None: no row has one, or no LoRA)."""
        lora = None if self._lora_state is None else self._lora_state.rows
        if lora is None:
            return None
        tensors = {"row_slots": (lora.slots, torch.long), "row_scales": (lora.scales, torch.float32),
                   "order": (lora.order, torch.long), "group_offsets": (lora.group_offsets, torch.long)}
        if lora.slots.shape != (rows,):
            raise ValueError(f"the step's LoRA rows are for {lora.slots.shape[0]} tokens, the step has {rows}")
        struct = np.zeros((), dtype=_LORA_ROWS)
        for name, (tensor, dtype) in tensors.items():
            if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise ValueError(f"the LoRA rows' {name} must be a contiguous CPU {dtype} tensor")
            struct[name] = tensor.data_ptr()
        struct["groups"] = lora.group_offsets.shape[0] - 1
        return torch.from_numpy(struct.reshape(1).view(np.uint8))

    def _bind_pool(self, kv_caches: list[tuple[Any, Any]]) -> None:
        """Point every layer at its KV in this pool (once per pool: the runner passes the same list each step)."""
        key = tuple(_cache_data(cache).data_ptr() for pair in kv_caches for cache in pair)
        if key == self._pool_key:
            self._kv_caches = kv_caches
            return
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model {len(self._layers)}")
        first = _cache_data(kv_caches[0][0])
        num_blocks, block_size, kv_heads, head_dim = first.shape
        if (kv_heads, head_dim) != (self._model["kv_heads"], self._model["head_dim"]) or first.dtype not in _KV_KINDS:
            raise ValueError(f"the KV pool's layout {tuple(first.shape)} {first.dtype} does not fit the model")
        for struct, (key_cache, value_cache) in zip(self._layers, kv_caches):
            for cache in (key_cache, value_cache):
                data = _cache_data(cache)
                if data.shape != first.shape or data.dtype != first.dtype or not data.is_contiguous():
                    raise ValueError("every layer's key and value caches must be contiguous and of one shape and dtype")
                if isinstance(cache, QuantizedKV) and not cache.scales.is_contiguous():
                    raise ValueError("int8 KV scales must be contiguous")
            struct["key_cache"] = _cache_data(key_cache).data_ptr()
            struct["value_cache"] = _cache_data(value_cache).data_ptr()
            quantized = isinstance(key_cache, QuantizedKV) and isinstance(value_cache, QuantizedKV)
            struct["key_scales"] = key_cache.scales.data_ptr() if quantized else 0
            struct["value_scales"] = value_cache.scales.data_ptr() if quantized else 0
        self._model["kv_kind"] = _KV_KINDS[first.dtype]
        self._model["block_size"] = block_size
        self._model["num_slots"] = num_blocks * block_size
        self._pool_key, self._kv_caches = key, kv_caches


def build_fused_decoder(model: nn.Module) -> FusedDecoder | None:
    """The fused decode step for a packed ``model``, or None where it does not apply (see the module docstring)."""
    decoder = model.model
    weight = decoder.norm.weight
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or decoder.norm.fused is None:
        return None
    attn = decoder.layers[0].self_attn
    if attn.head_dim > _MAX_HEAD_DIM or attn.head_dim % 2 or attn.num_heads % attn.num_kv_heads:
        return None
    max_rows = FUSED_DECODE_MAX_ROWS
    for layer in decoder.layers:
        if layer.mlp.fused is None:  # SiLU only
            return None
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if not all(_fits(projection) for projection in projections):
            return None
        # Bit for bit the layer-by-layer path only where that path runs the same kernels (the bf16 kernel
        # serves every row count; the quantized methods dequantize above theirs).
        max_rows = min([max_rows] + [
            projection.method.kernel_max_rows for projection in projections
            if not isinstance(projection.method, UnquantizedLinearMethod)
        ])
    kernels = load_kernel_ops()
    if kernels is None:
        return None
    sizes = tuple(kernels.ops.fused_decode_struct_sizes(kernels.variant, which) for which in range(4))
    if sizes != (_PROJECTION.itemsize, _LAYER.itemsize, _MODEL.itemsize, _LORA_ROWS.itemsize):
        logger.warning("CPU fused decode step: the C structs (%s bytes) do not match their mirrors here; not used",
                       sizes)
        return None
    return FusedDecoder(kernels, model, max_rows)


def _fits(projection: nn.Module) -> bool:
    # A tensor-parallel wrapper (an all-reduce after the product) is not served, nor a layer without a C kernel.
    if type(projection) is not PackedLinear:
        return False
    if isinstance(projection.method, UnquantizedLinearMethod):
        return projection._dense_gemm is not None and projection._dense_gemm.dtype == torch.bfloat16
    return (
        isinstance(projection.method, (Int8LinearMethod, Int4LinearMethod))
        and projection._quant_kernels is not None
        and projection.in_features % _QBLOCK == 0
        and (projection.bias is None or projection.bias.dtype == torch.bfloat16)
    )


def _projection(layer: PackedLinear) -> np.ndarray:
    """The C struct of one packed projection (a 0-d array of ``_PROJECTION``)."""
    struct = np.zeros((), dtype=_PROJECTION)
    gemm = layer._dense_gemm
    if gemm is not None:
        struct["kind"] = _BF16
        struct["qweight"] = gemm.panels.data_ptr()
        struct["bias"] = 0 if gemm.bias is None else gemm.bias.data_ptr()
        struct["out_features"] = gemm.out_features
        struct["in_features"] = gemm.in_features
        struct["parallel"] = int(gemm.parallel)
        return struct
    int4 = isinstance(layer.method, Int4LinearMethod)
    struct["kind"] = _INT4 if int4 else _INT8
    struct["qweight"] = layer.qweight.data_ptr()
    struct["scales"] = layer.scales.data_ptr()
    struct["minimums"] = layer.minimums.data_ptr() if int4 else 0
    struct["group_size"] = layer.method.group_size if int4 else 0
    struct["bias"] = 0 if layer.bias is None else layer.bias.data_ptr()
    struct["out_features"] = layer.out_features
    struct["in_features"] = layer.in_features
    # As BoundGemm splits a projection over threads.
    struct["parallel"] = int(layer.qweight.numel() >= _PARALLEL_MIN_BYTES)
    return struct


def _cache_data(cache: torch.Tensor | QuantizedKV) -> torch.Tensor:
    return cache.data if isinstance(cache, QuantizedKV) else cache
