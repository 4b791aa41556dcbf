"""pdserve: an LLM inference server with disaggregated prefill and decode.

Every part lives under this one namespace: ``pdserve.engine`` (the model
runtime), ``pdserve.gateway`` (the public gRPC and OpenAI HTTP endpoint),
``pdserve.prefill_service`` and ``pdserve.decode_service`` (the workers),
``pdserve.kv_transfer``, ``pdserve.cluster_index``, ``pdserve.service_common``,
``pdserve.protos`` and the ``pdserve`` command (``pdserve.cli``).

The offline API is importable as vLLM's is::

    from pdserve import LLM, SamplingParams, StructuredOutputsParams

Its names are loaded lazily, on first use: ``import pdserve`` (or
``import pdserve.gateway``) loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.engine.llm import LLM
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from pdserve.engine.types.lora import LoRARequest
    from pdserve.engine.types.outputs import RequestOutput
    from pdserve.engine.types.sampling_params import SamplingParams
    from pdserve.engine.types.speculative import SpeculativeConfig
    from pdserve.engine.types.structured_outputs import StructuredOutputsParams

# Public name -> the module that defines it.
_LAZY = {
    "LLM": "pdserve.engine.llm",
    "SamplingParams": "pdserve.engine.types.sampling_params",
    "RequestOutput": "pdserve.engine.types.outputs",
    "LLMEngine": "pdserve.engine.llm_engine",
    "AsyncEngine": "pdserve.engine.async_engine",
    "EngineConfig": "pdserve.engine.types.config",
    "ModelConfig": "pdserve.engine.types.config",
    "CacheConfig": "pdserve.engine.types.config",
    "SchedulerConfig": "pdserve.engine.types.config",
    "ParallelConfig": "pdserve.engine.types.config",
    "SpeculativeConfig": "pdserve.engine.types.speculative",
    "StructuredOutputsParams": "pdserve.engine.types.structured_outputs",
    "LoRARequest": "pdserve.engine.types.lora",
}

__all__ = [
    "AsyncEngine", "CacheConfig", "EngineConfig", "LLM", "LLMEngine", "ModelConfig", "ParallelConfig",
    "LoRARequest", "RequestOutput", "SamplingParams", "SchedulerConfig", "SpeculativeConfig",
    "StructuredOutputsParams",
]
assert sorted(__all__) == sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
