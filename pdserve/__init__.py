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
    from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from pdserve.engine.llm import LLM
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.outputs import RequestOutput
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.spec_decode.config import SpeculativeConfig
    from pdserve.engine.lora import LoRARequest
    from pdserve.engine.structured_output import StructuredOutputsParams

# Public name -> the module that defines it.
_LAZY = {
    "LLM": "pdserve.engine.llm",
    "SamplingParams": "pdserve.engine.sampling_params",
    "RequestOutput": "pdserve.engine.outputs",
    "LLMEngine": "pdserve.engine.llm_engine",
    "AsyncEngine": "pdserve.engine.async_engine",
    "EngineConfig": "pdserve.engine.config",
    "ModelConfig": "pdserve.engine.config",
    "CacheConfig": "pdserve.engine.config",
    "SchedulerConfig": "pdserve.engine.config",
    "ParallelConfig": "pdserve.engine.config",
    "SpeculativeConfig": "pdserve.engine.spec_decode.config",
    "StructuredOutputsParams": "pdserve.engine.structured_output",
    "LoRARequest": "pdserve.engine.lora",
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
