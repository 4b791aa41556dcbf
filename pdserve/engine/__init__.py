"""pdserve's model runtime: paged KV cache, prefix caching, continuous batching.

The public names are imported lazily so that ``import pdserve.engine.types.hashing`` (what the
gateway needs) loads neither torch nor the model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.types.outputs import RequestOutput
    from pdserve.engine.types.sampling_params import SamplingParams
    from pdserve.engine.types.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]

_LAZY = {
    "LLM": "pdserve.engine.llm",
    "LLMEngine": "pdserve.engine.llm_engine",
    "RequestOutput": "pdserve.engine.types.outputs",
    "SamplingParams": "pdserve.engine.types.sampling_params",
    "StructuredOutputsParams": "pdserve.engine.types.structured_outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
