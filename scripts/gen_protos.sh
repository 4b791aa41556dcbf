#!/usr/bin/env bash
# Regenerates the Python stubs (with .pyi types) of the .proto sources in pdserve/protos/.
# The public API's stubs go into the client package (pdserve_client/v1/), which installs
# on its own; pdserve/protos/pdserve/v1/generation_pb2*.py only re-export them. The internal
# worker stubs stay next to their source. protoc runs with pdserve/ as its include root, so the
# files keep the names clients and reflection know (protos/pdserve/v1/...). Run from anywhere;
# the venv from scripts/setup.sh must exist.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PY" -m grpc_tools.protoc -I pdserve --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/pdserve/v1/generation.proto protos/pdserve/v1/internal/worker.proto
cp "$out"/protos/pdserve/v1/generation_pb2.py "$out"/protos/pdserve/v1/generation_pb2.pyi \
  "$out"/protos/pdserve/v1/generation_pb2_grpc.py pdserve_client/v1/
cp "$out"/protos/pdserve/v1/internal/worker_pb2.py "$out"/protos/pdserve/v1/internal/worker_pb2.pyi \
  "$out"/protos/pdserve/v1/internal/worker_pb2_grpc.py pdserve/protos/pdserve/v1/internal/
# protoc names imports after the .proto's path; the public messages' module is the client's,
# the internal ones live under the pdserve package.
sed -i 's/^from protos\.pdserve\.v1 import generation_pb2 as /from pdserve_client.v1 import generation_pb2 as /' \
  pdserve_client/v1/generation_pb2_grpc.py pdserve/protos/pdserve/v1/internal/worker_pb2.py \
  pdserve/protos/pdserve/v1/internal/worker_pb2.pyi
sed -i 's/^from protos\.pdserve\.v1\.internal import worker_pb2 as /from pdserve.protos.pdserve.v1.internal import worker_pb2 as /' \
  pdserve/protos/pdserve/v1/internal/worker_pb2_grpc.py
sed -i "s/'protos\.pdserve\.v1\.internal\.worker_pb2'/'pdserve.protos.pdserve.v1.internal.worker_pb2'/" \
  pdserve/protos/pdserve/v1/internal/worker_pb2.py
# The stubs refuse a grpcio older than the one that generated them: pin the check to the oldest
# grpcio the packages accept (pyproject.toml, client/pyproject.toml), whatever grpcio-tools ran here.
sed -i "s/^GRPC_GENERATED_VERSION = '[0-9.]*'/GRPC_GENERATED_VERSION = '1.85.1'/" \
  pdserve_client/v1/generation_pb2_grpc.py pdserve/protos/pdserve/v1/internal/worker_pb2_grpc.py
