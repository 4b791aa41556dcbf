"""Loading tiny random Hugging Face checkpoints, built at test time, through pdserve.engine.model_loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, Qwen2Config, Qwen2ForCausalLM

from pdserve.engine.model_loader import (
    HUB_ALLOW_PATTERNS,
    load_eos_token_ids,
    load_hf_config,
    load_weights,
    resolve_model_path,
)

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)


def _llama_config() -> LlamaConfig:
    return LlamaConfig(**_TINY, tie_word_embeddings=False)


def _qwen2_config() -> Qwen2Config:
    return Qwen2Config(**_TINY, tie_word_embeddings=True)


def _build(model_class: Any, config: PretrainedConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        # The default init leaves biases and norms at constants; randomise everything so
        # equality after loading proves each tensor was copied.
        for param in model.parameters():
            param.normal_()
    return model.eval()


def _save(model: Any, folder: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def _assert_all_equal(loaded: torch.nn.Module, reference: torch.nn.Module) -> None:
    loaded_params = dict(loaded.named_parameters(remove_duplicate=False))
    reference_params = dict(reference.named_parameters(remove_duplicate=False))
    assert loaded_params.keys() == reference_params.keys()
    for name, param in reference_params.items():
        assert torch.equal(loaded_params[name], param), name


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single_file", "sharded"])
def test_llama_checkpoint_loads_every_tensor_exactly(tmp_path: Path, max_shard_size: str | None) -> None:
    reference = _build(LlamaForCausalLM, _llama_config(), seed=0)
    folder = _save(reference, tmp_path, max_shard_size)
    if max_shard_size:
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("model-*.safetensors"))) > 2
    else:
        assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]
    fresh = _build(LlamaForCausalLM, _llama_config(), seed=1)
    assert not torch.equal(fresh.model.layers[1].mlp.down_proj.weight, reference.model.layers[1].mlp.down_proj.weight)

    load_weights(fresh, folder, tie_word_embeddings=False)

    _assert_all_equal(fresh, reference)
    assert fresh.lm_head.weight is not fresh.model.embed_tokens.weight


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single_file", "sharded"])
def test_tied_qwen2_checkpoint_loads_embedding_into_shared_head(tmp_path: Path, max_shard_size: str | None) -> None:
    reference = _build(Qwen2ForCausalLM, _qwen2_config(), seed=0)
    folder = _save(reference, tmp_path, max_shard_size)
    saved_keys = set()
    for shard in folder.glob("*.safetensors"):
        saved_keys |= load_file(shard).keys()
    assert "lm_head.weight" not in saved_keys
    assert "model.layers.0.self_attn.q_proj.bias" in saved_keys
    fresh = _build(Qwen2ForCausalLM, _qwen2_config(), seed=1)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight

    load_weights(fresh, folder, tie_word_embeddings=True)

    _assert_all_equal(fresh, reference)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, reference.model.embed_tokens.weight)


def test_weights_are_cast_to_the_parameter_dtype(tmp_path: Path) -> None:
    reference = _build(LlamaForCausalLM, _llama_config(), seed=0)
    folder = _save(reference, tmp_path)
    fresh = _build(LlamaForCausalLM, _llama_config(), seed=1).to(torch.bfloat16)

    load_weights(fresh, folder, tie_word_embeddings=False)

    for name, param in reference.named_parameters():
        loaded = fresh.get_parameter(name)
        assert loaded.dtype == torch.bfloat16
        assert torch.equal(loaded, param.to(torch.bfloat16)), name


def _rewrite_single_file(folder: Path, edit: Any) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_raises_naming_it_and_leaves_model_untouched(tmp_path: Path) -> None:
    folder = _save(_build(LlamaForCausalLM, _llama_config(), seed=0), tmp_path)
    _rewrite_single_file(folder, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    fresh = _build(LlamaForCausalLM, _llama_config(), seed=1)
    before = {name: p.clone() for name, p in fresh.named_parameters()}

    with pytest.raises(ValueError, match=r"1 missing parameters: model\.layers\.1\.mlp\.down_proj\.weight"):
        load_weights(fresh, folder, tie_word_embeddings=False)

    for name, param in fresh.named_parameters():
        assert torch.equal(param, before[name]), name


def test_untied_checkpoint_without_head_reports_it_missing(tmp_path: Path) -> None:
    folder = _save(_build(LlamaForCausalLM, _llama_config(), seed=0), tmp_path)
    _rewrite_single_file(folder, lambda t: t.pop("lm_head.weight"))

    with pytest.raises(ValueError, match=r"1 missing parameters: lm_head\.weight"):
        load_weights(_build(LlamaForCausalLM, _llama_config(), seed=1), folder, tie_word_embeddings=False)


def test_unexpected_tensor_and_shape_mismatch_are_reported(tmp_path: Path) -> None:
    folder = _save(_build(LlamaForCausalLM, _llama_config(), seed=0), tmp_path)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        tensors["model.norm.weight"] = torch.zeros(63)

    _rewrite_single_file(folder, edit)

    with pytest.raises(ValueError) as raised:
        load_weights(_build(LlamaForCausalLM, _llama_config(), seed=1), folder, tie_word_embeddings=False)
    assert str(raised.value) == (
        "Checkpoint does not match the model: "
        "1 unexpected checkpoint tensors: model.layers.0.self_attn.extra.weight; "
        "1 shape mismatches: model.norm.weight: checkpoint [63] vs model [64]"
    )


def test_rotary_inv_freq_in_checkpoint_is_skipped(tmp_path: Path) -> None:
    reference = _build(LlamaForCausalLM, _llama_config(), seed=0)
    folder = _save(reference, tmp_path)
    _rewrite_single_file(
        folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    )
    fresh = _build(LlamaForCausalLM, _llama_config(), seed=1)

    load_weights(fresh, folder, tie_word_embeddings=False)

    _assert_all_equal(fresh, reference)


def test_tied_flag_with_untied_model_raises(tmp_path: Path) -> None:
    folder = _save(_build(Qwen2ForCausalLM, _qwen2_config(), seed=0), tmp_path)
    untied = _build(LlamaForCausalLM, _llama_config(), seed=1)

    with pytest.raises(ValueError, match=r"lm_head\.weight is not the same tensor as model\.embed_tokens\.weight"):
        load_weights(untied, folder, tie_word_embeddings=True)


def test_folder_without_safetensors_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="No \\*.safetensors files in"):
        load_weights(_build(LlamaForCausalLM, _llama_config(), seed=0), tmp_path, tie_word_embeddings=False)


def test_load_hf_config_reads_the_saved_config(tmp_path: Path) -> None:
    _save(_build(Qwen2ForCausalLM, _qwen2_config(), seed=0), tmp_path)

    config = load_hf_config(tmp_path)

    assert isinstance(config, Qwen2Config)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert config.tie_word_embeddings is True


def test_eos_token_ids_come_from_generation_config_list(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    config = LlamaConfig(**_TINY, eos_token_id=5)

    assert load_eos_token_ids(tmp_path, config) == frozenset({2, 7})


def test_eos_token_id_int_in_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))

    assert load_eos_token_ids(tmp_path, LlamaConfig(**_TINY, eos_token_id=5)) == frozenset({9})


def test_eos_token_ids_fall_back_to_model_config(tmp_path: Path) -> None:
    assert load_eos_token_ids(tmp_path, LlamaConfig(**_TINY, eos_token_id=5)) == frozenset({5})
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert load_eos_token_ids(tmp_path, LlamaConfig(**_TINY, eos_token_id=[5, 6])) == frozenset({5, 6})


def test_eos_token_ids_empty_when_nothing_declares_them(tmp_path: Path) -> None:
    assert load_eos_token_ids(tmp_path, LlamaConfig(**_TINY, eos_token_id=None)) == frozenset()


def test_resolve_model_path_returns_local_folder_unchanged(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_resolve_model_path_downloads_hub_id_with_allow_patterns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    calls: list[tuple[str, list[str]]] = []

    def fake_snapshot_download(repo_id: str, *, allow_patterns: list[str]) -> str:
        calls.append((repo_id, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)

    assert resolve_model_path("org/some-model") == tmp_path
    assert calls == [("org/some-model", list(HUB_ALLOW_PATTERNS))]


def test_resolve_model_path_unknown_model_raises_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def failing_snapshot_download(repo_id: str, *, allow_patterns: list[str]) -> str:
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing_snapshot_download)

    with pytest.raises(ValueError, match=r"'no/such-model' is neither a local folder nor a downloadable"):
        resolve_model_path("no/such-model")


@pytest.mark.parametrize("model", [None, "default"])
def test_resolve_model_path_default_uses_the_embedded_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str | None
) -> None:
    import pdserve.engine.model_loader

    monkeypatch.setattr(pdserve.engine.model_loader, "ensure_default_model", lambda: tmp_path / "converted")

    assert resolve_model_path(model) == tmp_path / "converted"
