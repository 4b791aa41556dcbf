#!/usr/bin/env bash
# The test suite: install, make sure Redis answers on 127.0.0.1:6379, run every test
# (GPU tests skip themselves without CUDA). pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/ensure_redis.sh
exec .venv/bin/python -m pytest "$@"
