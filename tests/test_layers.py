"""The import contracts of pyproject.toml ([tool.importlinter]): `lint-imports` keeps every one of them, and every
module of the engine has its place in the engine's layers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
CONTRACT_IDS = ["packages", "no-circles", "engine", "kv", "value-types", "engine-offline", "gateway-torch-free"]


def _config() -> dict:
    with open(REPO_ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["tool"]["importlinter"]


def test_lint_imports_keeps_every_contract() -> None:
    contracts = _config()["contracts"]
    assert [contract["id"] for contract in contracts] == CONTRACT_IDS
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = " ".join(result.stdout.split())  # its lines are wrapped at the terminal's width
    for contract in contracts:
        assert f"{contract['name']} KEPT" in report
    assert f"Contracts: {len(CONTRACT_IDS)} kept, 0 broken." in report


def _modules_under(package: Path, name: str) -> set[str]:
    modules = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.add(".".join((name, *parts)))
    return modules


def test_every_engine_module_sits_in_a_layer_of_the_engine() -> None:
    """The engine's contract names modules and packages (``parallel`` spans several layers), so a new module
    would be outside every layer, unchecked: it must be given one."""
    (engine,) = [contract for contract in _config()["contracts"] if contract["id"] == "engine"]
    layered = {name.strip() for layer in engine["layers"] for name in layer.split("|")}
    # Package __init__ modules that hold only a docstring: nothing to layer.
    containers = {"pdserve.engine", "pdserve.engine.parallel"}
    outside = sorted(
        module for module in _modules_under(REPO_ROOT / "pdserve" / "engine", "pdserve.engine") - containers
        if not any(module == name or module.startswith(name + ".") for name in layered)
    )
    assert outside == []
    assert all(_modules_under(REPO_ROOT / "pdserve" / "engine", "pdserve.engine") >= {name} for name in layered)
