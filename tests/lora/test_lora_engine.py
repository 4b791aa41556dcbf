"""LoRA in the engine: greedy float32 output equals transformers' with the adapter merged into the base weights
(W + scale B A, by PEFT), token for token, for base rows and several adapters in one batch, through chunked
prefill, prefix hits and preemption, with adapters swapped through fewer slots, on Llama, Qwen2, Qwen3, Gemma 2 and
a windowed Mistral; refusals name the adapter. A bfloat16 model keeps its adapters bfloat16 and decodes adapter rows
in the fused step, bit for bit the layer-by-layer path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.llama import sliding_windows
from pdserve.engine.types.lora import LoRARequest
from tests.conftest import FAMILY_CONFIGS, family_of, random_prompts

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


class MergedOracle:
    """transformers' greedy generate on the base checkpoint with an adapter merged in (None: the base)."""

    def __init__(self, base: Path, **config: object) -> None:
        self.base = base
        self.config = config  # overrides of the checkpoint's config (e.g. sliding_window=None)
        self._models: dict[Path | None, object] = {}

    def generate(self, prompt: list[int], adapter: Path | None) -> list[int]:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        if adapter not in self._models:
            model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32, **self.config)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
            # ignore_eos generates past EOS without masking it, as tests/conftest.py's greedy_continuations
            # (min_new_tokens would mask it: another token wherever EOS is the argmax).
            model.generation_config.eos_token_id = None
            self._models[adapter] = model.eval()
        model = self._models[adapter]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,  # type: ignore[attr-defined]
                                 do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def oracle(llama_checkpoint: Path) -> MergedOracle:
    return MergedOracle(llama_checkpoint)


def _requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(sorted(adapters.items()))}


@pytest.fixture(scope="module")
def family_oracle(lora_checkpoint: Path) -> MergedOracle:
    return MergedOracle(lora_checkpoint)


def test_base_rows_and_two_adapters_in_one_batch_equal_the_merged_models(
    lora_checkpoint: Path, family_adapters: dict[str, Path], family_oracle: MergedOracle
) -> None:
    adapters, oracle = family_adapters, family_oracle
    requests = _requests(adapters)
    prompts = random_prompts([5, 17, 40, 9, 33, 64], seed=80)
    chosen = [None, "attn", "mlp", "attn", None, "mlp"]
    llm = LLM(model=str(lora_checkpoint), dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    assert llm.engine.lora is not None and llm.engine.lora.layers[0]["qkv_proj"].lora_a.dtype == torch.float32
    outputs = llm.generate(prompts, GREEDY, [requests[name] if name else None for name in chosen])
    for prompt, name, out in zip(prompts, chosen, outputs):
        assert out.token_ids == oracle.generate(prompt, adapters[name] if name else None), name
    # The adapters change the output (the test would pass trivially otherwise).
    assert outputs[1].token_ids != oracle.generate(prompts[1], None)
    assert outputs[2].token_ids != oracle.generate(prompts[2], None)
    if family_of(lora_checkpoint) == "mistral":
        # Mistral's window (48) bites on the 64-token prompt: attending to the whole context gives other tokens.
        assert outputs[5].token_ids != MergedOracle(lora_checkpoint, sliding_window=None).generate(
            prompts[5], adapters["mlp"])


def test_one_slot_swaps_adapters_and_chunked_prefill_preemption_and_prefix_hits_stay_exact(
    lora_checkpoint: Path, family_adapters: dict[str, Path], family_oracle: MergedOracle
) -> None:
    adapters, oracle = family_adapters, family_oracle
    requests = _requests(adapters)
    prompts = random_prompts([70, 95, 40, 120], seed=81)
    chosen = ["attn", "mlp", None, "attn"]
    # One slot: the "mlp" request waits until every "attn" request running has finished, then swaps it in.
    # 14 blocks of 16 tokens with 32-token chunks: preemption and recompute under the adapters. Where every layer
    # slides (Mistral) the blocks its window has passed are freed: 10 (the 120-token prompt and its output fit).
    every_layer_slides = all(window is not None
                             for window in sliding_windows(FAMILY_CONFIGS[family_of(lora_checkpoint)]()))
    llm = LLM(model=str(lora_checkpoint), dtype="float32", num_kv_blocks=10 if every_layer_slides else 14,
              max_num_batched_tokens=32, enable_lora=True, max_loras=1, max_lora_rank=8)
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


def test_a_bf16_engine_decodes_fused_with_and_without_adapters_as_the_layer_by_layer_engine(
    llama_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    from tests.unit.test_fused_decode import CountingDecoder

    prompts = random_prompts([7, 30, 61], seed=85)
    # INT8 projections: fused on every CPU variant (unquantized bf16 ones are fused only with AVX512-BF16).
    model = str(llama_checkpoint)
    llm = LLM(model=model, dtype="bfloat16", num_kv_blocks=64, quantization="int8", enable_lora=True, max_loras=2,
              max_lora_rank=8)
    eager = LLM(model=model, dtype="bfloat16", num_kv_blocks=64, quantization="int8", enable_lora=True, max_loras=2,
                max_lora_rank=8, enforce_eager=True)
    plain = LLM(model=model, dtype="bfloat16", num_kv_blocks=64, quantization="int8")
    assert llm.engine.model.fused_decoder is not None, "a bf16 model on pdserve's CPU kernels gets the fused step"
    assert eager.engine.model.fused_decoder is None
    # A bfloat16 model's adapters are kept bfloat16 (half what a step reads); a float32 model's float32.
    assert llm.engine.lora is not None
    assert {linear.lora_b.dtype for layer in llm.engine.lora.layers for linear in layer.values()} == {torch.bfloat16}
    steps: list[int] = []
    llm.engine.model.fused_decoder = CountingDecoder(llm.engine.model.fused_decoder, steps)
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == [
        out.token_ids for out in plain.generate(prompts, GREEDY)]
    assert len(steps) >= MAX_TOKENS - 1  # the decode steps of base rows ran fused
    steps.clear()
    requests = _requests(adapters)
    chosen = [None, requests["attn"], requests["mlp"]]
    tuned = llm.generate(prompts, GREEDY, chosen)
    assert len(steps) >= MAX_TOKENS - 1  # and those with adapter rows too
    assert [out.token_ids for out in tuned] == [out.token_ids for out in eager.generate(prompts, GREEDY, chosen)]
    assert tuned[1].token_ids != plain.generate(prompts[1:2], GREEDY)[0].token_ids


@pytest.mark.parametrize("quantization", ["int8", None])
def test_fused_decode_steps_with_adapter_rows_equal_the_layer_by_layer_path_bit_for_bit(
    llama_checkpoint: Path, adapters: dict[str, Path], quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.engine.layers import linear as linear_module
    from pdserve.engine.layers.dense_kernels import load_dense_kernels
    from pdserve.engine.lora import LoRAManager
    from pdserve.engine.types.lora import LoRAConfig
    from tests.unit.test_fused_decode import CPU, Pair

    # As tests/unit/test_fused_decode.py does: unquantized bf16 layers on pdserve's kernel on every CPU.
    dense = load_dense_kernels()
    monkeypatch.setattr(linear_module, "_dense_kernels", lambda dtype: dense)
    pair = Pair(llama_checkpoint, quantization, torch.bfloat16)
    manager = LoRAManager(pair.model, LoRAConfig(max_loras=2, max_lora_rank=8))
    assert pair.model.fused_decoder is pair.fused
    slot = {name: manager.acquire(request) for name, request in _requests(adapters).items()}
    chosen = [slot["attn"], -1, slot["mlp"], slot["attn"], slot["mlp"], -1, slot["mlp"]]
    lengths = [2 + (i * 3) % 11 for i in range(len(chosen))]
    manager.set_rows(chosen, lengths, CPU)
    prompts = pair.add_sequences(lengths)
    manager.set_rows(chosen, [1] * len(chosen), CPU)
    last = [prompt[-1] for prompt in prompts]
    for step in range(4):
        chunks = [(i, [last[i]], len(prompts[i]) + step) for i in range(len(chosen))]
        fused, layer_by_layer = pair.step(chunks)
        assert torch.equal(fused, layer_by_layer), f"step {step}"
        pair.assert_pools_equal()
        last = pair.greedy(fused)
    # The same step without the adapters' rows: the base rows' hidden states are the same bits, the others not.
    manager.set_rows([-1] * len(chosen), [1] * len(chosen), CPU)
    base, _ = pair.step(chunks)
    for row, chosen_slot in enumerate(chosen):
        assert torch.equal(base[row], fused[row]) == (chosen_slot < 0), row
