"""A static security scan (checkov) of the rendered Kubernetes manifests and of the Dockerfile.

No check may fail; a check skipped on purpose carries its reason next to the skip (a
``checkov.io/skipN`` annotation or a ``#checkov:skip=`` comment), and the reasons are pinned here
so that a new skip is a decision someone reads.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import REPO, VARIANTS, find_tool, prepare_tree, render

# Every skip, by check: each has its reason beside it in the manifests (README.md, Security).
EXPECTED_SKIPS = {
    "CKV_K8S_43",  # image digests: images are chosen per cluster in the overlay's images list
    "CKV_K8S_15",  # imagePullPolicy Always: tags are immutable; IfNotPresent allows locally built images
    "CKV_DOCKER_2",  # HEALTHCHECK: one image serves three roles; the orchestrator probes each role's health port
}


def _checkov() -> str:
    checkov = find_tool("checkov", "PDSERVE_CHECKOV")
    assert checkov is not None, "checkov is not installed: run scripts/setup.sh (it installs it into .venv-tools)"
    return checkov


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = tmp_path_factory.mktemp("scan")
    root = prepare_tree(directory)
    files = []
    for name in VARIANTS:
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(render(root / "variants" / name)))
        files.append(path)
    command = [_checkov(), "--framework", "kubernetes", "dockerfile", "--skip-download", "--compact", "-o", "json",
               "-f", str(REPO / "Dockerfile"), *(arg for path in files for arg in ("-f", str(path)))]
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=directory, env=env, timeout=300)
    assert result.stdout.strip(), f"checkov printed nothing: {result.stderr[-2000:]}"
    reports = json.loads(result.stdout)
    return reports if isinstance(reports, list) else [reports]


def test_checkov_scanned_the_manifests_and_the_dockerfile(scan: list[dict]) -> None:
    by_type = {report["check_type"]: report["summary"] for report in scan}
    assert set(by_type) == {"kubernetes", "dockerfile"}
    assert by_type["kubernetes"]["resource_count"] >= 4 * len(VARIANTS)
    assert by_type["kubernetes"]["passed"] > 100 and by_type["dockerfile"]["passed"] > 10
    assert all(summary["parsing_errors"] == 0 for summary in by_type.values())


def test_no_check_fails(scan: list[dict]) -> None:
    failed = [(c["check_id"], c["resource"], c.get("file_path")) for report in scan
              for c in report["results"]["failed_checks"]]
    assert failed == []


def test_every_skipped_check_is_an_expected_one_with_its_reason(scan: list[dict]) -> None:
    skipped = [c for report in scan for c in report["results"].get("skipped_checks", [])]
    assert skipped, "the skips below are expected to be reported"
    assert {c["check_id"] for c in skipped} == EXPECTED_SKIPS
    for check in skipped:
        # Kubernetes skips report it as suppress_comment, Dockerfile skips within check_result.
        reason = check.get("suppress_comment") or check.get("check_result", {}).get("suppress_comment") or ""
        assert len(reason.split()) >= 5, (check["check_id"], check["resource"], check)


def test_the_gitignored_secrets_are_not_in_the_tree_checkov_would_scan() -> None:
    # Real keys are generated per cluster (gen-secrets.sh), never committed.
    tracked = subprocess.run(["git", "ls-files", "deploy/kubernetes"], cwd=REPO, capture_output=True, text=True).stdout
    assert not [line for line in tracked.splitlines() if line.endswith((".crt", ".key", "auth-token"))]
    assert Path(REPO / "deploy/kubernetes/base/secrets/README.md").exists()
