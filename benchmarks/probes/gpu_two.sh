#!/bin/bash
# Two GPUs of one host, after MLX is staged (../shared/docs/GPU.md): the commands as a user
# starts them with mlx.launch (tensor parallel over NCCL, a GPU per rank; a pipeline over the
# ring backend, where mlx.launch leaves every rank on GPU 0), on the demo model, then
# tests/test_distributed.py. The figures come from benchmarks/distributed.py.
# Usage: bash benchmarks/probes/gpu_two.sh
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
GEN=(python3 -m moeflux_mlx.cli generate --prompt "Tell me something wise." --max-tokens 48)
LAUNCH=(python3 -c "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; sys.exit(main())" -n 2)
echo "== one process"
timeout 120 "${GEN[@]}" 2>&1 | grep -v "^Loading\|^Fetching"
echo "== tensor parallel, NCCL, a GPU per rank (mlx.launch --backend nccl)"
timeout 150 "${LAUNCH[@]}" --backend nccl -- "${GEN[@]}" 2>&1 | grep -v "^Fetching\|Connected successfully" | tail -8
echo "rc ${PIPESTATUS[0]}"
echo "== pipeline, ring (mlx.launch --backend ring: both ranks on GPU 0)"
timeout 150 "${LAUNCH[@]}" --backend ring --starting-port 45210 -- "${GEN[@]}" --pipeline 2>&1 | grep -v "^Fetching" | tail -8
echo "rc ${PIPESTATUS[0]}"
echo "== tests/test_distributed.py"
MOEFLUX_TEST_LAUNCH_TIMEOUT=280 timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py 2>&1 | tail -5
