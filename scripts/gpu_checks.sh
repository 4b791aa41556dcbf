#!/usr/bin/env bash
# The project's GPU checks in one run, for a machine with a CUDA GPU (CI has none):
#   the tests under tests/gpu, the KV transfer between two processes on the GPU
#   (cuda_ipc beside grpc and shm), and the offline throughput benchmark on the
#   GPU in float32 and bfloat16 against transformers on the same GPU.
#
#   bash scripts/gpu_checks.sh [OUT_DIR]      # logs and JSON figures land in OUT_DIR (default gpu-results)
#
# It runs with the machine's own python3 and torch (PYTHON=... to choose another)
# and does not install the project: the repository root goes on PYTHONPATH.
# Packages the machine lacks can come as wheels in .whl/ (installed into
# /tmp/pdserve-site, nothing else touched). The benchmark model is a random-weight
# checkpoint of the default model's shape (benchmarks/random_checkpoint.py), so no
# weights are needed. Each step has its own time limit; a failing step is
# reported and the next one still runs; the exit status is the tests'.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/pdserve-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/pdserve-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, keep its log, report its status
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S))"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.log"
    echo "=== $name: exit $rc"
    return $rc
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$py" -c 'import sys, torch, transformers, grpc, google.protobuf as pb
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "grpcio", grpc.__version__, "protobuf", pb.__version__)
print("devices:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
    "$py" -c 'import flash_attn; print("flash_attn", flash_attn.__version__)' 2>&1 | tail -n 1
} >"$out/environment.txt" 2>&1
cat "$out/environment.txt"

step gpu_tests 240 "$py" -m pytest -m gpu tests/gpu -v -rs -p no:cacheprovider
tests=$?
step kv_transfer 90 "$py" -m benchmarks.kv_transfer --device cuda:0 --repeats 5 --json "$out/kv_transfer.json"
model=/tmp/pdserve-smollm2-random
[ -f "$model/model.safetensors" ] || step random_checkpoint 60 "$py" -m benchmarks.random_checkpoint "$model"
for dtype in float32 bfloat16; do
    step "offline_$dtype" 150 "$py" -m benchmarks.offline_throughput --model "$model" --device cuda:0 \
        --dtype "$dtype" --num-prompts 128 --output-len 128 --num-kv-blocks 4096 --static-batch-size 32 \
        --json "$out/offline_$dtype.json"
done
exit $tests
