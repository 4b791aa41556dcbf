#!/usr/bin/env bash
# The test suite: install, then run every test (GPU tests skip themselves without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
