"""What the gateway and the client import, each in a fresh interpreter (this one has torch loaded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torchfree.environment import REPO_ROOT

# torch itself, the engine's modules, and transformers' model code (modeling_utils, models.*.modeling_*).
_LISTED = (
    "import json, sys; print(json.dumps(sorted(name for name in sys.modules if name.split('.')[0] == 'torch' "
    "or name.split('.')[:2] == ['pdserve', 'engine'] or (name.startswith('transformers.') and 'modeling' in name))))"
)

# The engine modules the gateway loads: the value types it checks and converts requests with (block hashes, errors,
# sampling parameters, structured-output specs, LoRA requests, logprobs) and the structured-output module that checks
# grammars before routing.
_GATEWAY_ENGINE_MODULES = sorted([
    "pdserve.engine", "pdserve.engine.structured_output", "pdserve.engine.types", "pdserve.engine.types.errors",
    "pdserve.engine.types.hashing", "pdserve.engine.types.lora", "pdserve.engine.types.outputs",
    "pdserve.engine.types.sampling_params", "pdserve.engine.types.structured_outputs",
])
_VALUE_TYPE_MODULES = ("config", "errors", "handoff", "hashing", "lora", "outputs", "sampling_params", "speculative",
                       "structured_outputs")


def _heavy_modules_after(statement: str, *argv: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", f"{statement}\n{_LISTED}", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        # The gateway needs the engine's value types and its grammar checks (before routing), nothing else.
        ("import pdserve.gateway.server", _GATEWAY_ENGINE_MODULES),
        # What `pdserve gateway` imports before it loads a tokenizer: the CLI, the gateway, its HTTP API.
        ("import pdserve.cli, pdserve.gateway.server, pdserve.gateway.http_api, pdserve.gateway.tokenizer",
         _GATEWAY_ENGINE_MODULES),
        # The engine's value types, all of them: plain Python.
        ("import " + ", ".join(f"pdserve.engine.types.{name}" for name in _VALUE_TYPE_MODULES),
         sorted(["pdserve.engine", "pdserve.engine.types", *(f"pdserve.engine.types.{n}" for n in _VALUE_TYPE_MODULES)])),
        # The one namespace: importing it, or asking what it offers, loads nothing heavy.
        ("import pdserve; dir(pdserve)", []),
        ("import pdserve.client", []),
        ("import pdserve_client", []),
    ],
)
def test_the_gateway_and_the_client_import_neither_torch_nor_model_code(statement: str, expected: list[str]) -> None:
    assert _heavy_modules_after(statement) == expected


def test_the_default_tokenizer_loads_without_torch_where_torch_is_installed(tmp_path: Path) -> None:
    """What `pdserve gateway` does at start with the default model, in an interpreter that could import torch."""
    statement = (
        "import os, sys; os.environ['PDSERVE_CACHE_DIR'] = sys.argv[1]; from pdserve.gateway.tokenizer import load_tokenizer; "
        "tokenizer = load_tokenizer(None); "
        "assert tokenizer('The capital of France is')['input_ids'] == [504, 3575, 282, 4649, 314]"
    )
    assert _heavy_modules_after(statement, str(tmp_path)) == [
        "pdserve.engine", "pdserve.engine.default_model", "pdserve.engine.gguf_tokenizer"
    ]


def test_autotokenizer_gives_the_default_tokenizer_the_same_class_and_ids(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from pdserve.engine.default_model import ensure_default_tokenizer

    folder = ensure_default_tokenizer(tmp_path)
    auto, direct = AutoTokenizer.from_pretrained(str(folder)), PreTrainedTokenizerFast.from_pretrained(str(folder))
    assert type(auto) is type(direct)
    text = "The capital of France is Paris. 你好 🙂"
    assert auto(text)["input_ids"] == direct(text)["input_ids"]
    messages = [{"role": "user", "content": "Hi!"}]
    assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert (auto.eos_token_id, auto.bos_token_id) == (direct.eos_token_id, direct.bos_token_id) == (2, 1)
