#!/bin/bash
# One device call: the GPU tests of the device-side table (GPU_TESTS=... adds more), the stall probe, then the
# decode benchmark. Usage on the GPU machine, after MLX is staged (../shared/docs/GPU.md):
#   bash benchmarks/gpu_session.sh [LAYERS] [ROUNDS] [DECODE_TOKENS]
# Budgets below 100% run with both slot lookups (host sync, device-side table); ROUNDS > 1 adds
# stock and the all-resident model (ops and kernel backends) decoding in turn, ROUNDS times.
set -u
LAYERS=${1:-8}
ROUNDS=${2:-7}
TOKENS=${3:-128}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# a stalled device-table wait gives up after 5 s instead of 60 (DeviceWaitError)
export MOEFLUX_WAIT_TIMEOUT_S=5
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import mlx.core as mx, psutil, tqdm; print('mlx', mx.__version__, mx.default_device())"
# a test stuck 60 s dumps every thread's stack
timeout 240 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 \
  tests/test_device_table.py ${GPU_TESTS:-} > "$OUT/gpu_tests.txt" 2>&1
echo "tests: $(tail -1 "$OUT/gpu_tests.txt")"
grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests.txt" | head -20
timeout 60 python3 benchmarks/table_stall_probe.py --size tiny > "$OUT/stall_probe.txt" 2>&1
grep -E "^(RESULT|FAILED|layer|run|warm-up|stats)" "$OUT/stall_probe.txt"; grep "^monitor" "$OUT/stall_probe.txt" | tail -4
timeout ${BENCH_TIMEOUT:-900} python3 benchmarks/decode.py --arch qwen3_moe --size full --layers "$LAYERS" \
  --build-dir /tmp/bench-models --decode-tokens "$TOKENS" --prompt-tokens 128 --budgets 1,0.99,0.25 \
  --io ${IO:-pread,mmap} --prefetch off --repeats "$ROUNDS" --out "$OUT" \
  > "$OUT/bench_log.txt" 2>&1
grep -v "^expert \|building\|it/s\]" "$OUT/bench_log.txt" | tail -25
