"""LoRA adapters written at test time in PEFT's format, on the tiny Llama, with random (non-zero) B matrices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def write_adapter(base: Path, folder: Path, seed: int, **lora: object) -> Path:
    """A PEFT LoRA adapter of ``base`` saved in ``folder``; PEFT starts B at zero, so every weight is drawn here."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def adapters(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of different ranks and targets: attention and MLP; one with rsLoRA's scaling."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": write_adapter(llama_checkpoint, root / "attn", 1, r=4, lora_alpha=8,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "mlp": write_adapter(llama_checkpoint, root / "mlp", 2, r=8, lora_alpha=4, use_rslora=True,
                             target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"]),
    }
