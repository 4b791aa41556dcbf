from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_import_cluster_index_loads_neither_torch_nor_grpc() -> None:
    # A fresh interpreter: this test process has torch loaded by the shared conftest.
    code = (
        "import sys, pdserve.cluster_index\n"
        "heavy = sorted(m for m in ('torch', 'grpc', 'pdserve.engine.kv.block_manager') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
