#!/bin/bash
# Two source trees of moeflux-mlx side by side on one machine, in one call: the decode benchmark
# (stock mlx-lm, every expert resident paired over rounds, 25% budget cold) and the fused-kernel
# benchmark, alternating old / new twice. For a change that must not move the figures (a
# refactor): the ratios of each tree to stock mlx-lm, taken in the same call, should agree
# within the machine's noise. Usage, from the repository root, with MLX importable:
#   bash benchmarks/probes/tree_ab.sh OLD_TREE [LAYERS] [ROUNDS]
# OLD_TREE: a copy of the other tree, e.g. `git archive REV | tar -x -C OLD_TREE`. Results go
# to $OUT (default /tmp/out)/tree-ab/. PAIRS="1" runs each tree once (default "1 2": twice).
set -u
OLD=$(cd "$1" && pwd); NEW=$(pwd)
LAYERS=${2:-4}
ROUNDS=${3:-3}
OUT=${OUT:-/tmp/out}/tree-ab; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MOEFLUX_WAIT_TIMEOUT_S=5
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/root/mlx-ptx-cache}
BASE_PYTHONPATH=${PYTHONPATH:-}
ARGS=(--arch qwen3_moe --size full --layers "$LAYERS" --build-dir /tmp/tree-ab-models
      --decode-tokens "${TOKENS:-48}" --prompt-tokens 64 --io pread --prefetch off --convert
      --budgets 1,0.25 --repeats "$ROUNDS")
run() {  # run TREE LABEL: the decode and kernel benchmarks of that tree, its package first
  local tree=$1 label=$2
  ( cd "$tree" && PYTHONPATH="$tree${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}" \
      timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/decode.py "${ARGS[@]}" \
      --machine "$label" --out "$OUT" > "$OUT/$label-decode.txt" 2>&1 )
  echo "== $label decode"; grep -E "^\| (stock|moeflux)|median ratio|Greedy|Ceiling" "$OUT/$label-decode.txt" \
    | cut -c1-160
  if [ "${KERNELS:-1}" = 1 ]; then
    ( cd "$tree" && PYTHONPATH="$tree${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}" \
        timeout 120 python3 benchmarks/kernels.py --models qwen3-30b-a3b qwen3.5-397b-a17b \
        --reps 20 --out "$OUT" --tag "$label" \
        > "$OUT/$label-kernels.txt" 2>&1 )
    echo "== $label kernels"; grep -E "^\| (qwen|deepseek)" "$OUT/$label-kernels.txt" | cut -c1-160
  fi
}
for i in ${PAIRS:-1 2}; do
  run "$OLD" "old$i"
  run "$NEW" "new$i"
done
