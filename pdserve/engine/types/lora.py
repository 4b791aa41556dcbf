"""Which LoRA adapter a request runs under, and how many adapters an engine serves (vLLM's names).

Value types, torch-free: the adapters themselves are loaded and applied by
``pdserve.engine.lora`` and ``pdserve.engine.layers.lora``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: the adapter's name (what the OpenAI ``model`` field says), a positive integer id
    unique to it, and its folder in PEFT's format."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA settings: ``max_loras`` adapters resident at once, ranks up to ``max_lora_rank``,
    ``max_cpu_loras`` (default ``max_loras``) kept loaded in host memory."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or
                                               self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be None or an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
