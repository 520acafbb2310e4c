#!/bin/bash
# One device call: GPU tests of the device-side table and the cache, then the decode benchmark.
# Usage on the GPU machine, after MLX is staged (README): bash benchmarks/gpu_session.sh [LAYERS] [REPEATS]
# The benchmark runs the 99% budget with both slot lookups; with MOEFLUX_DEVICE_TABLE=1 set, every
# budget below 100% uses the (experimental) device-side table and the extra 99% row is the host sync.
set -u
LAYERS=${1:-8}
REPEATS=${2:-5}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import mlx.core as mx, psutil, tqdm; print('mlx', mx.__version__, mx.default_device())"
# a stalled device-table wait gives up after 10 s; a test stuck 40 s dumps every thread's stack
MOEFLUX_WAIT_TIMEOUT_S=10 timeout 150 python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=40 \
  tests/test_device_table.py 2>&1 | tail -80 > "$OUT/gpu_tests.txt"; tail -5 "$OUT/gpu_tests.txt"
MOEFLUX_WAIT_TIMEOUT_S=10 python3 benchmarks/decode.py --arch qwen3_moe --size full --layers "$LAYERS" --build-dir /tmp/bench-models \
  --decode-tokens 64 --prompt-tokens 128 --budgets 1,0.99,0.25 --prefetch off --repeats "$REPEATS" \
  --machine h100 --out "$OUT" 2>&1 | grep -v "^expert \|building" | tail -30
