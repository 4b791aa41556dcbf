"""Typed configuration of the engine, grouped by the part that reads it."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.types.lora import LoRAConfig
from pdserve.engine.types.speculative import SpeculativeConfig

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "sdpa", "cpu_paged", "flash_attn")
# Weight-only quantization of the decoder's projections (pdserve/engine/layers/linear.py); None keeps the checkpoint's floats.
QUANTIZATIONS = (None, "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
# "auto": the model's dtype. int8 keeps a float32 scale per token and KV head (pdserve/engine/kv/cache.py).
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, pool size and prefix caching."""

    block_size: int = 16
    # None: size the pool from available memory (see kv_cache.size_kv_pool).
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # Share of the memory available after loading the model that the pool may
    # take; None: 0.8 of free GPU memory, 0.1 of available host memory on CPU
    # (where a 2-core machine saturates long before a large pool fills).
    kv_memory_fraction: float | None = None
    # One of KV_CACHE_DTYPES (vLLM's name): what the pool stores keys and values in.
    kv_cache_dtype: str = "auto"
    # vLLM's name: keep every block in sliding-window layers too (engine.kv.pages frees what windows leave
    # behind unless this is set).
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be None or an integer >= 1, got {self.num_kv_blocks!r}")
        if self.kv_memory_fraction is not None and not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run, in which dtype, on which device."""

    model: str | None = None  # local folder, GGUF file, hub id, or None for the embedded default
    dtype: str = "auto"
    device: str = "auto"  # "auto" picks cuda when available
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    seed: int = 0  # seeds the sampler's generator for requests without a seed
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS; pdserve/engine/attention/selector.py says what auto picks
    quantization: str | None = None  # one of QUANTIZATIONS, applied at load to any float checkpoint
    quantization_group_size: int = 32  # input columns per INT4 scale/zero; must divide every projection's in_features
    # Under quantization, the LM head in INT8 too (llama.cpp's GGUF keeps it in Q8_0; vLLM leaves it unquantized).
    quantize_lm_head: bool = True
    # vLLM's name (there: no CUDA graphs). Here: no fused decode step; every step runs the model layer by
    # layer in torch. The fused step (pdserve/engine/models/fused_decode.py) serves small decode batches of bf16
    # INT8/INT4 models on CPU and gives the same results bit for bit; this switch is for comparisons.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be None or an integer >= 1, got {self.max_model_len!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {self.quantization_group_size!r}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks (processes) one engine runs over (vLLM's ``ParallelConfig``); pdserve/engine/parallel/."""

    # vLLM's name: ranks the attention heads and the MLP are split over (Megatron-style).
    tensor_parallel_size: int = 1
    # Seconds any collective inside a step may wait for the other ranks before the engine fails.
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be positive, got {self.collective_timeout_s!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    # None: no speculative decoding (vLLM's name; pdserve/engine/spec_decode/).
    speculative_config: SpeculativeConfig | None = None
    # A prefill engine with a draft model: build the draft's prompt KV beside the
    # target's for every request it holds for a handoff, and hand both over
    # (default: the decode engine recomputes it). Needs a draft_model speculative_config.
    handoff_draft_kv: bool = False
    # The one deadline for whatever a KV handoff holds that nobody claims: a prefill engine's lease on a
    # finished request's blocks, KV pushed to a decode engine whose request never comes, a decode
    # worker's early start that no Decode claims (``pdserve ... --kv-handoff-timeout``).
    kv_handoff_timeout_s: float = 30.0
    # LoRA adapters (vLLM's enable_lora with its max_loras, max_lora_rank, max_cpu_loras); None: off.
    lora_config: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.kv_handoff_timeout_s, (int, float)) and self.kv_handoff_timeout_s > 0):
            raise ValueError(f"kv_handoff_timeout_s must be a positive number of seconds, "
                             f"got {self.kv_handoff_timeout_s!r}")
        if self.handoff_draft_kv and (
            self.speculative_config is None or self.speculative_config.method != "draft_model"
        ):
            raise ValueError("handoff_draft_kv needs a speculative_config with method 'draft_model' (the draft to run)")
