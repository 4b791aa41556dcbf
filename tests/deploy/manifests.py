"""Rendering deploy/kubernetes with kustomize (``kubectl kustomize``), and reading what it renders.

The tools come from the install path: kubectl from the machine (Debian/Google's package) or, where
none with kustomize v5 is installed, the one scripts/setup.sh unpacks into .venv-tools/bin;
checkov from .venv-tools (its own venv: its pins would downgrade the project's packages).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = REPO / "deploy" / "kubernetes"
TOOLS_BIN = REPO / ".venv-tools" / "bin"
OVERLAYS = ("cpu", "nvidia-gpu")
COMPONENTS = ("openai-http", "autoscaling", "nccl-kv-transfer")
# What each rendered variant is made of: every overlay alone (each lists openai-http itself), and with every
# other component that fits it (NCCL is for GPUs).
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cpu": ("cpu", ()),
    "nvidia-gpu": ("nvidia-gpu", ()),
    "cpu+autoscaling": ("cpu", ("autoscaling",)),
    "nvidia-gpu+autoscaling+nccl": ("nvidia-gpu", ("autoscaling", "nccl-kv-transfer")),
}


def find_tool(name: str, env_var: str) -> str | None:
    """``$env_var``, else .venv-tools/bin/NAME, else NAME on PATH."""
    if os.environ.get(env_var):
        return os.environ[env_var]
    local = TOOLS_BIN / name
    if local.exists():
        return str(local)
    return shutil.which(name)


def kubectl() -> str:
    """A kubectl whose kustomize renders components (v4 or later), or an AssertionError saying how to get one."""
    for candidate in (find_tool("kubectl", "PDSERVE_KUBECTL"), shutil.which("kubectl")):
        if candidate is None:
            continue
        version = subprocess.run([candidate, "version", "--client"], capture_output=True, text=True).stdout
        match = re.search(r"Kustomize Version: v(\d+)", version)
        if match and int(match.group(1)) >= 4:
            return candidate
    raise AssertionError("no kubectl with kustomize v4 or later: run scripts/setup.sh (it installs one into "
                         ".venv-tools/bin) or set PDSERVE_KUBECTL")


def prepare_tree(directory: Path) -> Path:
    """A copy of deploy/kubernetes with generated secrets and one overlay per variant; its root."""
    root = directory / "kubernetes"
    shutil.copytree(KUBERNETES_DIR, root, ignore=shutil.ignore_patterns("*.crt", "*.key", "auth-token"))
    env = {**os.environ, "PDSERVE_SECRETS_DIR": str(root / "base" / "secrets")}
    subprocess.run([str(root / "gen-secrets.sh")], env=env, check=True, capture_output=True)
    for name, (overlay, components) in VARIANTS.items():
        variant = root / "variants" / name
        variant.mkdir(parents=True)
        (variant / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [f"../../overlays/{overlay}"],
            "components": [f"../../components/{component}" for component in components],
        }))
    return root


def render(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass(frozen=True)
class Rendered:
    """One variant's objects, with the lookups the checks need."""

    name: str
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: {kind} {name}: {len(found)} found"
        return found[0]

    def workloads(self) -> Iterator[dict[str, Any]]:
        yield from self.of_kind("Deployment")

    def component(self, component: str) -> dict[str, Any]:
        [deployment] = [d for d in self.workloads()
                        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        return deployment


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions; {} selects everything)."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True
