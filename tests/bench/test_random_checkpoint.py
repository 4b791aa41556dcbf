"""The GPU benchmarks' stand-in model: the default model's shapes with random weights, loaded by both systems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import offline_throughput
from benchmarks.random_checkpoint import SMOLLM2_135M, write_random_checkpoint


@pytest.mark.slow
def test_the_preset_is_the_converted_default_models_architecture() -> None:
    from pdserve.engine.default_model import ensure_default_model

    converted = json.loads((ensure_default_model() / "config.json").read_text(encoding="utf-8"))
    assert {key: converted[key] for key in SMOLLM2_135M} == SMOLLM2_135M


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("smollm2_shaped"), num_layers=1, seed=3)


def test_a_written_checkpoint_has_the_shapes_and_loads_in_the_engine(one_layer: Path) -> None:
    from safetensors import safe_open

    with safe_open(one_layer / "model.safetensors", "pt") as weights:
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (3 * 64, 576)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (1536, 576)
    assert "lm_head.weight" not in shapes  # tied, as in SmolLM2
    assert json.loads((one_layer / "config.json").read_text(encoding="utf-8"))["num_hidden_layers"] == 1


def test_offline_throughput_runs_both_systems_in_the_dtype_asked_and_they_agree(one_layer: Path) -> None:
    argv = ["--model", str(one_layer), "--num-prompts", "3", "--min-len", "5", "--max-len", "9", "--output-len", "4",
            "--num-kv-blocks", "32", "--skip-hf-cb", "--device", "cpu"]
    argv.append("--skip-machine-limits")
    report = offline_throughput.main(argv)
    assert report["config"]["dtype"] == "float32"
    assert report["environment"]["device"] == "cpu"
    # float32 greedy: pdserve and transformers emit the same tokens.
    assert report["agreement"]["pdserve_vs_hf_static"]["num_identical"] == 3
    bf16 = offline_throughput.main([*argv, "--dtype", "bfloat16"])
    assert bf16["config"]["dtype"] == "bfloat16"
    assert set(bf16["results"]) == {"pdserve", "pdserve_prefill_only", "hf_static"}


@pytest.mark.parametrize(("argv", "measured"), [
    ([], True),
    (["--skip-machine-limits"], False),
    (["--device", "cuda:0", "--dtype", "bfloat16"], False),
    (["--device", "cpu", "--dtype", "bfloat16"], True),
])
def test_the_cpu_machine_limits_are_measured_on_cpu_runs_only(argv: list[str], measured: bool) -> None:
    assert offline_throughput.measures_machine_limits(offline_throughput.parse_args(argv)) is measured
