#!/bin/bash
# The GPU tests of the device-side table (GPU_TESTS=... adds more test files), the decode
# benchmark, the 25% budget with and without prefetch (PREFETCH=0 skips), and the store's cold reads
# with and without readahead (DISK=0 skips), the host probe's A/B of the miss server's poll
# cap (POLL=0 skips), and where a cold token's time goes in mlx-lm's pipelined loop (OVERLAP=0
# skips; it reads the converted model the main benchmark made). A device call runs
# at most 10 minutes: TESTS=0 / MAIN=0 split the work over calls. Usage on the GPU machine, after
# MLX is staged (../shared/docs/GPU.md):
#   bash benchmarks/gpu_session.sh [LAYERS] [ROUNDS] [DECODE_TOKENS]
# Budgets below 100% run with both slot lookups (host sync, device-side table), and 100% also
# through the table (the lookup alone); ROUNDS > 1 adds stock and the all-resident model (ops and
# kernel backends, and the kernels through the table: the lookup alone, paired) decoding in turn,
# ROUNDS times. A fresh machine first spends minutes in
# NVRTC compiling kernels (docs/benchmarks.md, known problems): BENCH_TIMEOUT covers that.
#
# ROUTING="bound pagecache policy prefetch ops spec prefill dist compare" runs the real-routing
# parts instead (the others then default to off): the trained demo's routing replayed over Qwen3-30B-A3B-sized
# experts (64 per layer, 8 layers, converted, pread, 25% cold): the default policy's fraction of
# the I/O bound BOUND_RUNS times (2; BOUND_IO="pread direct" also uncached, in turns) after the
# store's cold reads of miss-sized batches, its schemes side by side (store_read_ab.py
# --shares-ab); pread with a page cache of shares of the experts against direct (PC_RUNS);
# LRU and decay vs the default policy (transition),
# prefetch of the trace's recorded ridge / gate predictions, the ops backend's tokens against
# stock, prompt-lookup speculation and prefill at 25% (benchmarks/speculation.py, prefill.py),
# two ranks on the one GPU (tests/test_distributed.py, and NCCL), and `compare`'s KL rule.
set -u
if [ -n "${ROUTING:-}" ]; then
  : "${TESTS:=0}" "${MAIN:=0}" "${OVERLAP:=0}" "${PREFETCH:=0}" "${DISK:=0}" "${POLL:=0}"
fi
LAYERS=${1:-8}
ROUNDS=${2:-3}
TOKENS=${3:-64}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# a stalled device-table wait gives up after 5 s instead of 60 (DeviceWaitError)
export MOEFLUX_WAIT_TIMEOUT_S=5
# NVRTC's output kept on disk: later calls on the same warm machine skip the minutes of compiling
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/root/mlx-ptx-cache}
BENCH=(python3 benchmarks/decode.py --arch qwen3_moe --size full --layers "$LAYERS"
       --build-dir /tmp/bench-models --decode-tokens "$TOKENS" --prompt-tokens 128
       --io "${IO:-pread}" --prefetch off --convert)  # a later --prefetch overrides; --convert:
       # the experts stream from packed_experts/, as for a model larger than RAM (stock: the plain one)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import mlx.core as mx, psutil, tqdm; print('mlx', mx.__version__, mx.default_device())"
# TESTS=0 / MAIN=0 skip the tests / the main benchmark (to split the work over device calls)
if [ "${TESTS:-1}" = 1 ]; then  # a test stuck 60 s dumps every thread's stack
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 \
  tests/test_device_table.py ${GPU_TESTS:-} > "$OUT/gpu_tests.txt" 2>&1
echo "tests: $(tail -1 "$OUT/gpu_tests.txt")"
grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests.txt" | head -20
fi
if [ "${MAIN:-1}" = 1 ]; then
timeout "${BENCH_TIMEOUT:-420}" "${BENCH[@]}" --budgets 1,0.99,0.25 --repeats "$ROUNDS" \
  --out "$OUT" > "$OUT/bench_log.txt" 2>&1
grep -v "^expert \|building\|it/s\]\|transformers" "$OUT/bench_log.txt" | tail -16
fi
if [ "${OVERLAP:-1}" = 1 ] && [ -d "/tmp/bench-models/qwen3_moe-full-${LAYERS}l-packed" ]; then
  MODEL=/tmp/bench-models/qwen3_moe-full-${LAYERS}l
  timeout 300 python3 benchmarks/probes/overlap_probe.py "$MODEL-packed" --stock "$MODEL" --budgets 0.25 \
    --rounds "$ROUNDS" > "$OUT/overlap_probe.txt" 2>&1
  echo "overlap probe:"; grep "^|" "$OUT/overlap_probe.txt"
fi
if [ "${PREFETCH:-1}" = 1 ]; then  # prefetch on the table path (hint_cuda.cuh), 25% cold
  timeout 300 "${BENCH[@]}" --budgets 0.25 --no-stock --prefetch both \
    --machine prefetch --out "$OUT/prefetch" > "$OUT/bench_prefetch_log.txt" 2>&1
  echo "prefetch:"; grep -E "^\| moeflux" "$OUT/bench_prefetch_log.txt"
fi
if [ "${DISK:-1}" = 1 ]; then  # the VM disk's readahead and the store's cold reads (no GPU)
  timeout 300 python3 benchmarks/probes/store_read_ab.py --dir /tmp/read-ab \
    --sweep 256:8,256:16,1024:8,2048:8 > "$OUT/store_read_ab.txt" 2>&1
  echo "store reads:"; tail -16 "$OUT/store_read_ab.txt"
fi
if [ "${POLL:-1}" = 1 ]; then  # the poller's host cost: fixed 20 us polls vs backing off to 1 ms
  MODEL=/tmp/bench-models/qwen3_moe-full-${LAYERS}l
  [ -d "$MODEL" ] || python3 -c "from pathlib import Path; from moeflux_mlx.testing import synth; \
synth.build_checkpoint(Path('$MODEL'), 'qwen3_moe', 'full', overrides={'num_hidden_layers': $LAYERS})"
  timeout "${POLL_TIMEOUT:-300}" python3 benchmarks/probes/host_probe.py "$MODEL" --rounds "$ROUNDS" \
    --poll-max-us 20,1000 > "$OUT/host_probe.txt" 2>&1
  echo "host probe:"; grep -v transformers "$OUT/host_probe.txt" | tail -12
fi

part() { case " ${ROUTING:-} " in *" $1 "*) return 0;; esac; return 1; }
TRACE=benchmarks/results/traces/2026-11-25-trained-text.npz
ROUTED=(python3 benchmarks/decode.py --arch qwen3_moe --size full --layers 8 --set num_experts=64
        --build-dir /tmp/bench-models --convert --io pread --routing-trace "$TRACE"
        --prompt-tokens 128 --decode-tokens "${ROUTED_TOKENS:-128}" --budgets 0.25)
if part bound; then  # the store's reads of miss batches, then the default policy's fraction of the bound
  # within one 10-minute device call: on a fresh machine the first decode also builds the model
  # and compiles the kernels (minutes), so run BOUND_RUNS=1 first, then again (SHARES=0 skips the probe)
  if [ "${SHARES:-1}" = 1 ]; then
    timeout 150 python3 benchmarks/probes/store_read_ab.py --dir /tmp/read-ab --shares-ab \
      --batches 8 --rounds 1 > "$OUT/shares_ab.txt" 2>&1
    echo "store reads:"; grep -E "^\||bandwidth|left out" "$OUT/shares_ab.txt"
  fi
  # BOUND_IO="pread direct": each run reads through the page cache and uncached, in turns
  read BOUND_IO_A BOUND_IO_B <<< "${BOUND_IO:-pread}"
  for run in $(seq "${BOUND_RUNS:-2}"); do
    for io in $( ((run % 2)) && echo "$BOUND_IO_A ${BOUND_IO_B:-}" || echo "${BOUND_IO_B:-} $BOUND_IO_A"); do
      timeout 200 "${ROUTED[@]/pread/$io}" --trace-predictor ridge --prefetch off --no-stock \
        --machine "bound-$io-$run" --out "$OUT/bound" > "$OUT/bound_${io}_$run.txt" 2>&1
      echo "bound, $io, run $run:"; grep -E "^\| moeflux" "$OUT/bound_${io}_$run.txt"
    done
  done
fi
if part pagecache; then  # where uncached reads stop paying: pread with a page cache of a share
  # of the experts (bench --page-cache SHARE: another process holds all of RAM but that share;
  # "page cache MB" is what it held), against direct and pread with the page cache dropped.
  # A run takes up to 300 s (filling a VM's RAM twice): split PC_RUNS over device calls
  for run in ${PC_RUNS:-direct dropped 0.1 0.25 0.5 kept}; do
    io=pread; keep=$run; [ "$run" = direct ] && io=direct keep=kept
    timeout 300 "${ROUTED[@]/pread/$io}" --trace-predictor ridge --prefetch off --no-stock \
      --page-cache "$keep" --machine "pc-$run" --out "$OUT/pagecache" > "$OUT/pc_$run.txt" 2>&1
    echo "page cache $run ($io), rc $?:"; grep -E "^\| moeflux|Error" "$OUT/pc_$run.txt"
  done
fi
if part policy; then  # LRU, decay and the default (transition), same replayed positions, cold
  # (POLICIES="lru transition" ROUTED_TOKENS=512: fewer, longer runs; through the table only,
  # the goal's path: POLICY_LOOKUP=both adds the host-synced one)
  for ev in ${POLICIES:-lru decay transition}; do
    MOEFLUX_EVICTION=$ev timeout 300 "${ROUTED[@]}" --trace-predictor ridge --prefetch off \
      --lookup "${POLICY_LOOKUP:-device}" --no-stock --machine "policy-$ev" --out "$OUT/policy" > "$OUT/policy_$ev.txt" 2>&1
    echo "policy $ev:"; grep -E "^\| moeflux" "$OUT/policy_$ev.txt"
  done
fi
if part prefetch; then  # prefetch of what the trained model's predictors predicted
  for pred in ridge gate; do
    timeout 300 "${ROUTED[@]}" --trace-predictor "$pred" --prefetch on --no-stock \
      --machine "prefetch-$pred" --out "$OUT/prefetch" > "$OUT/prefetch_$pred.txt" 2>&1
    echo "prefetch $pred:"; grep -E "^\| moeflux" "$OUT/prefetch_$pred.txt"
  done
fi
if part ops; then  # are the kernels' token flips rounding? the ops path against stock
  timeout 300 "${ROUTED[@]}" --trace-predictor ridge --prefetch off --bench-backend ops \
    --machine ops --out "$OUT/ops" > "$OUT/ops.txt" 2>&1
  echo "ops:"; grep -E "^\| |identical" "$OUT/ops.txt"
fi
if part spec; then  # prompt lookup on the demo model, 25% cold and all resident
  timeout 420 python3 benchmarks/speculation.py --budgets 0.25,1 --cold --expert-io pread \
    --repeats 3 --out "$OUT/spec" > "$OUT/spec.txt" 2>&1
  echo "speculation:"; grep -E "^\|" "$OUT/spec.txt" | tail -10
fi
if part prefill; then  # a 512-token prompt at 25%, warm page cache, against stock
  # PREFILL_VARIANTS, e.g. "--prefill-whole-layer 4 --prefetch on,off --trace-predictor ridge":
  # the steps after the prompt reading the next layer ahead, or not
  # shellcheck disable=SC2086
  timeout 420 python3 benchmarks/prefill.py --arch qwen3_moe --size full --layers 8 \
    --set num_experts=64 --build-dir /tmp/bench-models --convert --io pread --routing-trace "$TRACE" \
    --prompt-tokens 512 --budgets 0.25 ${PREFILL_VARIANTS:---prefill-whole-layer 4,0 --read-ahead on,off} \
    --repeats 5 --out "$OUT/prefill" > "$OUT/prefill.txt" 2>&1
  echo "prefill:"; grep -E "^\|" "$OUT/prefill.txt" | tail -8
fi
if part dist; then  # two ranks on the one GPU: the ring backend, then NCCL
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py \
    > "$OUT/dist_tests.txt" 2>&1
  echo "distributed tests: $(tail -1 "$OUT/dist_tests.txt")"
  grep -E "^(FAILED|ERROR)" "$OUT/dist_tests.txt" | head
  timeout 180 bash benchmarks/probes/gpu_ranks.sh > "$OUT/gpu_ranks.txt" 2>&1
  echo "ranks on one GPU:"; tail -30 "$OUT/gpu_ranks.txt"
fi
if part compare; then  # the demo model against stock on the GPU, KL rule
  timeout 300 python3 -m moeflux_mlx.cli compare > "$OUT/compare.txt" 2>&1
  echo "compare: rc $?"; tail -12 "$OUT/compare.txt"
fi
