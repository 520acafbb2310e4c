#!/bin/bash
# Two ranks on one GPU: what MLX's CUDA build offers for distributed streaming. Prints which
# backends this MLX has, `moeflux-mlx generate` on the demo model in one process, then in two
# ranks over the ring backend (pipeline and tensor parallel, both ranks on the one GPU), then
# NCCL's all_sum and a tensor-parallel generate with both ranks on GPU 0 (mlx.launch would give
# rank 1 CUDA device 1, which a one-GPU machine lacks, so the ranks are started by hand).
# Usage, on the GPU machine after MLX is staged: bash benchmarks/probes/gpu_ranks.sh
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 - <<'PY'
import mlx.core as mx
print("mlx", mx.__version__, mx.default_device())
print("backends:", {b: mx.distributed.is_available(b) for b in ("ring", "nccl", "mpi", "jaccl")})
PY
GEN=(python3 -m moeflux_mlx.cli generate --prompt "Tell me something wise." --max-tokens 64)
# mlx.launch's own entry point (python -m on its module would run nothing)
LAUNCH=(python3 -c "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; sys.exit(main())"
        -n 2 --backend ring --starting-port 45110 --)
echo "== one process"
timeout 120 "${GEN[@]}" 2>&1 | grep -v "^Loading\|^Fetching"
for flag in --pipeline ""; do
  echo "== two ranks on one GPU, ring backend, ${flag:-tensor parallel}"
  timeout 120 "${LAUNCH[@]}" "${GEN[@]}" $flag 2>&1 | grep -v "^Fetching" | tail -8
  echo "rc ${PIPESTATUS[0]}"
done
echo "== NCCL, both ranks on GPU 0: all_sum"
for r in 0 1; do
  MLX_RANK=$r MLX_WORLD_SIZE=2 NCCL_HOST_IP=127.0.0.1 NCCL_PORT=45120 CUDA_VISIBLE_DEVICES=0 \
    timeout 60 python3 -c "
import mlx.core as mx
g = mx.distributed.init(backend='nccl', strict=True)
x = mx.distributed.all_sum(mx.ones(4) * (g.rank() + 1))
mx.eval(x)
print('rank', g.rank(), 'of', g.size(), 'all_sum', x.tolist())
" > "/tmp/nccl_rank$r.txt" 2>&1 &
done
wait
for r in 0 1; do echo "-- rank $r"; tail -4 "/tmp/nccl_rank$r.txt"; done
echo "== NCCL, both ranks on GPU 0: tensor-parallel generate"
for r in 0 1; do
  MLX_RANK=$r MLX_WORLD_SIZE=2 NCCL_HOST_IP=127.0.0.1 NCCL_PORT=45121 CUDA_VISIBLE_DEVICES=0 \
    timeout 90 "${GEN[@]}" > "/tmp/nccl_gen$r.txt" 2>&1 &
done
wait
for r in 0 1; do echo "-- rank $r"; grep -v "^Fetching" "/tmp/nccl_gen$r.txt" | tail -5; done
