#!/usr/bin/env bash
# Regenerates the Python stubs (with .pyi types) next to the .proto sources.
# Run from anywhere; the venv from scripts/setup.sh must exist.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/pdserve/v1/generation.proto protos/pdserve/v1/internal/worker.proto
