"""Running Python as it would run where torch is not installed.

A child started by ``torch_free_command`` sees this interpreter's site-packages
through a folder of symbolic links that leaves out torch and every distribution
that requires it (accelerate, ...): ``import torch`` raises ModuleNotFoundError
and ``importlib.util.find_spec("torch")`` is None, as in the gateway's image,
so libraries that probe for torch (transformers) take their torch-free path.
"""

from __future__ import annotations

import importlib.metadata
import os
import site
import sys
from pathlib import Path

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[2]
_ALWAYS_MISSING = {"torch"}


def _requires(distribution: importlib.metadata.Distribution, names: set[str]) -> bool:
    for line in distribution.requires or []:
        requirement = Requirement(line)
        # Only what a plain install pulls in: requirements behind an extra are optional.
        if requirement.name.lower() in names and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
            return True
    return False


def _distributions_needing_torch() -> list[importlib.metadata.Distribution]:
    distributions = list(importlib.metadata.distributions())
    missing = set(_ALWAYS_MISSING)
    while True:
        more = {
            d.metadata["Name"].lower()
            for d in distributions
            if d.metadata["Name"].lower() not in missing and _requires(d, missing)
        }
        if not more:
            return [d for d in distributions if d.metadata["Name"].lower() in missing]
        missing |= more


def _top_level_entries(distribution: importlib.metadata.Distribution) -> set[str]:
    return {file.parts[0] for file in distribution.files or [] if file.parts and file.parts[0] != ".."}


def site_packages_without_torch(folder: Path) -> Path:
    """``folder`` filled with links to every site-packages entry except torch's and its dependents'."""
    left_out = set().union(*(_top_level_entries(d) for d in _distributions_needing_torch()))
    folder.mkdir(parents=True, exist_ok=True)
    for site_dir in map(Path, site.getsitepackages()):
        for entry in site_dir.iterdir():
            # .pth files (editable installs) are not read under -S; PYTHONPATH gives the repository instead.
            if entry.name in left_out or entry.suffix == ".pth" or entry.name == "__pycache__":
                continue
            link = folder / entry.name
            if not link.exists():
                link.symlink_to(entry)
    return folder


def torch_free_command(folder: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment for ``python -S args...`` that imports this repository and no torch."""
    packages = site_packages_without_torch(folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(packages)]), "PYTHONNOUSERSITE": "1"}
    return [sys.executable, "-S", *args], env
