#!/bin/bash
# One device call: upload paths, exactness vs stock mlx-lm, decode benchmark (see README).
# Usage on the GPU machine, after MLX is staged: bash benchmarks/gpu_session.sh [LAYERS]
set -u
LAYERS=${1:-8}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import mlx.core as mx, psutil, tqdm; print('mlx', mx.__version__, mx.default_device())"
python3 benchmarks/upload_probe.py 2>&1 | tee "$OUT/upload_probe.txt"
python3 benchmarks/sync_probe.py 2>&1 | tee "$OUT/sync_probe.txt"
python3 benchmarks/exactness.py --tokens 64 --backends ops --archs deepseek_v3 --machine h100-deepseek --out "$OUT" 2>&1 | grep -v INFO | tail -20
python3 benchmarks/exactness.py --tokens 64 --backends auto --machine h100-kernels --out "$OUT" 2>&1 | grep -v INFO | tail -20
python3 benchmarks/decode.py --arch qwen3_moe --size full --layers "$LAYERS" --build-dir /tmp/bench-models \
  --decode-tokens 48 --prompt-tokens 128 --budgets 1,0.99,0.25,0 --machine h100 --out "$OUT" 2>&1 | grep -v "^expert \|building" | tail -30
