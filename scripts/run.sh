#!/usr/bin/env bash
# The main job: install, then run the embedded default model and answer a few chat requests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/pdserve offline "$@"
