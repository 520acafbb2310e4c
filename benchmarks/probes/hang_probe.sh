#!/bin/bash
# Runs benchmarks/probes/table_stall_probe.py (a generation abandoned with tokens in flight, then a
# longer one) under a watchdog; if it is still running after WAIT seconds, dumps the native and
# Python stacks of it and its children with py-spy, and the GPU's utilization, then kills it.
# Usage on the GPU machine (py-spy on PATH): bash benchmarks/probes/hang_probe.sh [probe args...]
# Env: WAIT (default 45), OUT (default /tmp/out), TAG (file name suffix), MOEFLUX_DEVICE_TABLE.
set -u
WAIT=${WAIT:-45}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TAG=${TAG:-}
LOG="$OUT/hang_probe$TAG.txt"
python3 benchmarks/probes/table_stall_probe.py "$@" > "$LOG" 2>&1 &
PID=$!
for _ in $(seq 1 "$WAIT"); do
  sleep 1
  kill -0 "$PID" 2>/dev/null || break
done
if kill -0 "$PID" 2>/dev/null; then
  echo "HANG: still running after ${WAIT}s" | tee -a "$LOG"
  nvidia-smi --query-gpu=utilization.gpu --format=csv >> "$LOG" 2>&1
  for p in "$PID" $(pgrep -P "$PID"); do
    echo "=== py-spy dump --native --pid $p ($(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-80))" >> "$LOG"
    timeout 30 py-spy dump --native --pid "$p" >> "$LOG" 2>&1
  done
  kill -9 "$PID" $(pgrep -P "$PID") 2>/dev/null
fi
wait "$PID" 2>/dev/null
grep -E "^(RESULT|FAILED|HANG|run|warm-up)" "$LOG"
