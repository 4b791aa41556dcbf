"""LoRA adapters written at test time in PEFT's format, with random (non-zero) B matrices: on the tiny Llama, and on
each family whose layers change what an adapter's update passes through (``lora_checkpoint``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import FAMILY_CONFIGS, build_checkpoint

# The families the PEFT-merged exactness tests run on: Llama; Qwen2 (q/k/v biases after the update), Qwen3 (q/k
# norms over the updated q and k), Gemma 2 (sandwich norms, GeGLU, soft-caps, sliding and global layers) and
# Mistral (every layer's window, 48, shorter than the tests' prompts and outputs).
LORA_FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "mistral")


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


def write_two_adapters(base: Path, root: Path) -> dict[str, Path]:
    """Two adapters of ``base`` of different ranks and targets: attention ("attn") and MLP plus q ("mlp", with
    rsLoRA's scaling)."""
    return {
        "attn": write_adapter(base, root / "attn", 1, r=4, lora_alpha=8,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "mlp": write_adapter(base, root / "mlp", 2, r=8, lora_alpha=4, use_rslora=True,
                             target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"]),
    }


@pytest.fixture(scope="session")
def adapters(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama's two adapters (``write_two_adapters``)."""
    return write_two_adapters(llama_checkpoint, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="session", params=LORA_FAMILIES)
def lora_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint of each of ``LORA_FAMILIES``, its biases and norm weights drawn (transformers leaves them
    zero and one: a bias or a norm weight the adapter path dropped would change nothing)."""
    family = request.param
    return build_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}-"), FAMILY_CONFIGS[family](), seed=5,
                            draw_biases_and_norms=True)


@pytest.fixture(scope="session")
def family_adapters(lora_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``lora_checkpoint``'s two adapters (``write_two_adapters``)."""
    return write_two_adapters(lora_checkpoint, tmp_path_factory.mktemp(f"adapters-{lora_checkpoint.name}"))
