"""What the gateway and the client import, each in a fresh interpreter (this one has torch loaded)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.torchfree.environment import REPO_ROOT

# torch itself, the engine's modules, and transformers' model code.
_LISTED = (
    "import json, sys; print(json.dumps(sorted(name for name in sys.modules if name.split('.')[0] in "
    "('torch', 'engine') or name.startswith('transformers.model'))))"
)


def _heavy_modules_after(statement: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", f"{statement}\n{_LISTED}"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        # The gateway needs the engine's pure-Python block hash and error type, nothing else.
        ("import gateway.server", ["engine", "engine.errors", "engine.hashing"]),
        # What `pdserve gateway` imports before it loads a tokenizer: the CLI, the gateway, its HTTP API.
        ("import pdserve.cli, gateway.server, gateway.http_api, gateway.tokenizer",
         ["engine", "engine.errors", "engine.hashing"]),
        ("import pdserve.client", []),
        ("import pdserve_client", []),
    ],
)
def test_the_gateway_and_the_client_import_neither_torch_nor_model_code(statement: str, expected: list[str]) -> None:
    assert _heavy_modules_after(statement) == expected
