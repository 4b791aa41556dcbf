"""Converting the embedded SmolLM2 GGUF file into a cached safetensors folder (~20 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve.engine.default_model
from pdserve.engine.default_model import DEFAULT_MODEL_ID, default_cache_dir, ensure_default_model


def test_cache_dir_env_is_read_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "pdserve"


@pytest.mark.slow
def test_default_model_converts_once_into_a_plain_float_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = ensure_default_model(tmp_path)

    assert folder == tmp_path / "models" / DEFAULT_MODEL_ID
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert {"generation_config.json", "pdserve-converted.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["architectures"], config["dtype"], config["tie_word_embeddings"]) == (
        ["LlamaForCausalLM"],
        "float32",
        True,
    )
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    # Readable by other users sharing the cache.
    assert folder.stat().st_mode & 0o777 == 0o755
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o644
    # No temporary folder is left beside the result.
    assert [p.name for p in (tmp_path / "models").iterdir()] == [DEFAULT_MODEL_ID]

    marker = folder / "pdserve-converted.json"
    marker_mtime = marker.stat().st_mtime_ns

    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted a second time")

    monkeypatch.setattr(pdserve.engine.default_model, "_convert", must_not_convert)
    assert ensure_default_model(tmp_path) == folder
    assert marker.stat().st_mtime_ns == marker_mtime

    # It must load with the hub unreachable, as a plain (not quantized) model.
    check = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer; "
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); AutoTokenizer.from_pretrained(sys.argv[1]); "
        "print(type(m).__name__, getattr(m, 'hf_quantizer', None), getattr(m.config, 'quantization_config', None), "
        "m.dtype, m.num_parameters())"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, str(folder)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.split() == ["LlamaForCausalLM", "None", "None", "torch.float32", "134515008"]


@pytest.mark.slow
def test_incomplete_folder_without_marker_is_reconverted(tmp_path: Path) -> None:
    half_written = tmp_path / "models" / DEFAULT_MODEL_ID
    half_written.mkdir(parents=True)
    (half_written / "config.json").write_text("{}")

    folder = ensure_default_model(tmp_path)

    assert folder == half_written
    assert (folder / "pdserve-converted.json").is_file()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in (tmp_path / "models").iterdir()] == [DEFAULT_MODEL_ID]
