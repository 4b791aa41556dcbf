#!/usr/bin/env bash
# The main job: install, then serve the embedded default model as a local cluster
# (Redis if needed, one prefill and one decode worker, the gateway on 127.0.0.1:50051).
# Ask it from another terminal: .venv/bin/pdserve generate "The capital of France is"
# Arguments pass to `pdserve up` (e.g. --prefill-workers 2 --kv-transport shm). Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/pdserve up "$@"
