"""LoRA in the engine: greedy float32 output equals transformers' with the adapter merged into the base weights
(W + scale B A, by PEFT), token for token, for base rows and several adapters in one batch, through chunked
prefill, prefix hits and preemption, with adapters swapped through fewer slots; refusals name the adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.lora import LoRARequest
from tests.conftest import random_prompts

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


class MergedOracle:
    """transformers' greedy generate on the base checkpoint with an adapter merged in (None: the base)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._models: dict[Path | None, object] = {}

    def generate(self, prompt: list[int], adapter: Path | None) -> list[int]:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        if adapter not in self._models:
            model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
            self._models[adapter] = model.eval()
        model = self._models[adapter]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,  # type: ignore[attr-defined]
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def oracle(llama_checkpoint: Path) -> MergedOracle:
    return MergedOracle(llama_checkpoint)


def _requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(sorted(adapters.items()))}


def test_base_rows_and_two_adapters_in_one_batch_equal_the_merged_models(
    llama_checkpoint: Path, adapters: dict[str, Path], oracle: MergedOracle
) -> None:
    requests = _requests(adapters)
    prompts = random_prompts([5, 17, 40, 9, 33, 64], seed=80)
    chosen = [None, "attn", "mlp", "attn", None, "mlp"]
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    outputs = llm.generate(prompts, GREEDY, [requests[name] if name else None for name in chosen])
    for prompt, name, out in zip(prompts, chosen, outputs):
        assert out.token_ids == oracle.generate(prompt, adapters[name] if name else None), name
    # The adapters change the output (the test would pass trivially otherwise).
    assert outputs[1].token_ids != oracle.generate(prompts[1], None)
    assert outputs[2].token_ids != oracle.generate(prompts[2], None)


def test_one_slot_swaps_adapters_and_chunked_prefill_preemption_and_prefix_hits_stay_exact(
    llama_checkpoint: Path, adapters: dict[str, Path], oracle: MergedOracle
) -> None:
    requests = _requests(adapters)
    prompts = random_prompts([70, 95, 40, 120], seed=81)
    chosen = ["attn", "mlp", None, "attn"]
    # One slot: the "mlp" request waits until every "attn" request running has finished, then swaps it in.
    # 14 blocks of 16 tokens with 32-token chunks: preemption and recompute under the adapters.
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=14, max_num_batched_tokens=32,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    outputs = llm.generate(prompts, GREEDY, [requests[name] if name else None for name in chosen])
    for prompt, name, out in zip(prompts, chosen, outputs):
        assert out.token_ids == oracle.generate(prompt, adapters[name] if name else None), name
    assert llm.engine.scheduler.num_preemptions > 0
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_the_prefix_cache_is_keyed_by_adapter(llama_checkpoint: Path, adapters: dict[str, Path]) -> None:
    requests = _requests(adapters)
    prompt = random_prompts([48], seed=82)[0]
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    runs = [None, "attn", "attn", "mlp", None]
    cached = [llm.generate([prompt], GREEDY, requests[name] if name else None)[0].num_cached_tokens for name in runs]
    # The base's blocks serve the base only; an adapter's serve that adapter only.
    assert cached == [0, 0, 32, 0, 32]


def _adapter_copy(adapters: dict[str, Path], tmp_path: Path, name: str, **config: object) -> Path:
    folder = tmp_path / f"edited-{name}-{'-'.join(sorted(config))}"
    shutil.copytree(adapters[name], folder)
    settings = json.loads((folder / "adapter_config.json").read_text())
    settings.update(config)
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


def test_what_cannot_be_served_is_refused_naming_the_adapter_and_the_engine_keeps_serving(
    llama_checkpoint: Path, adapters: dict[str, Path], tmp_path: Path, oracle: MergedOracle,
    qwen3_moe_checkpoint: Path,
) -> None:
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=4)
    prompt = random_prompts([12], seed=83)[0]
    refused = [
        (LoRARequest("big", 1, str(adapters["mlp"])), r"'big'.*rank 8 is above --max-lora-rank 4"),
        (LoRARequest("saved", 2, str(_adapter_copy(adapters, tmp_path, "attn", modules_to_save=["lm_head"]))),
         r"'saved'.*modules_to_save not served"),
        (LoRARequest("dora", 3, str(_adapter_copy(adapters, tmp_path, "attn", use_dora=True))),
         r"'dora'.*use_dora \(DoRA\) not served"),
        (LoRARequest("embed", 4, str(_adapter_copy(adapters, tmp_path, "attn", target_modules=["embed_tokens"]))),
         r"'embed'.*target_modules \['embed_tokens'\] not served"),
        (LoRARequest("missing", 5, str(tmp_path / "nowhere")), r"'missing'.*cannot read adapter_config.json"),
    ]
    for request, message in refused:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], GREEDY, request)
    good = LoRARequest("attn", 6, str(adapters["attn"]))
    assert llm.generate([prompt], GREEDY, good)[0].token_ids == oracle.generate(prompt, adapters["attn"])
    with pytest.raises(ValueError, match="needs an engine built with LoRA"):
        LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=16).generate([prompt], GREEDY, good)
    with pytest.raises(ValueError, match="layer 0 has Attention and MoE"):
        LLM(model=str(qwen3_moe_checkpoint), dtype="float32", num_kv_blocks=16, enable_lora=True)
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=16, enable_lora=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_quantized_base_adds_each_rows_float_update_to_its_int8_projection(
    llama_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    """QLoRA-style serving: INT8 base projections, float adapters; a projection's output is the INT8 base's plus
    exactly the adapter's scaled update, for the rows under the adapter only."""
    from pdserve.engine.lora import load_adapter

    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=32, quantization="int8",
              enable_lora=True, max_loras=2, max_lora_rank=8)
    manager = llm.engine.lora
    assert manager is not None
    request = LoRARequest("attn", 1, str(adapters["attn"]))
    slot = manager.acquire(request)
    assert slot is not None
    adapter = load_adapter(request, 8, len(manager.layers))
    projection = manager.layers[1]["qkv_proj"]
    x = torch.randn(3, projection.lora_a.shape[1], generator=torch.Generator().manual_seed(0))
    manager.set_rows([slot, -1, slot], [1, 1, 1], torch.device("cpu"))
    out, base = projection(x), projection.base(x)
    expected = base.clone()
    for module, (start, end) in projection.slices.items():
        a, b = adapter.weights[1, module]
        expected[[0, 2], start:end] += (x[[0, 2]] @ a.T @ b.T) * adapter.scale
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], base[1])  # the base row: untouched
    manager.release(slot)
    prompt = random_prompts([20], seed=84)[0]
    (plain,), (tuned,) = llm.generate([prompt], GREEDY), llm.generate([prompt], GREEDY, request)
    assert plain.token_ids != tuned.token_ids


def test_a_bf16_engine_keeps_the_fused_decode_step_for_steps_without_an_adapter(
    llama_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    from pdserve.engine.lora import BaseStepsOnly

    prompts = random_prompts([7, 30, 61], seed=85)
    llm = LLM(model=str(llama_checkpoint), dtype="bfloat16", num_kv_blocks=64, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    plain = LLM(model=str(llama_checkpoint), dtype="bfloat16", num_kv_blocks=64)
    fused = llm.engine.model.fused_decoder
    assert isinstance(fused, BaseStepsOnly), "a bf16 model on pdserve's CPU kernels gets the fused step"
    steps: list[int] = []
    run = fused.decoder

    def counted(residual: torch.Tensor, *args: object) -> torch.Tensor:
        steps.append(residual.shape[0])
        return run(residual, *args)

    fused.decoder = type("Counted", (), {"serves": staticmethod(run.serves), "__call__": staticmethod(counted)})()
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == [
        out.token_ids for out in plain.generate(prompts, GREEDY)]
    assert len(steps) >= MAX_TOKENS - 1  # the decode steps of base rows only ran fused
    steps.clear()
    request = _requests(adapters)["attn"]
    tuned = llm.generate(prompts, GREEDY, [None, request, None])
    assert steps == []  # every step had the adapter's row: layer by layer, through the wrappers
    assert tuned[1].token_ids != plain.generate(prompts[1:2], GREEDY)[0].token_ids
