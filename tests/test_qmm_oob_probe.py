"""benchmarks/probes/mlx_qmm_oob_probe.py: it runs stock mlx-lm only, so that what the memory
checker finds in it is MLX's. In a process of its own: another test may have imported moeflux's
CUDA runtime into this one."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_probe_runs_stock_mlx_lm_alone():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "benchmarks/probes/mlx_qmm_oob_probe.py", "--only-qwen", "--rounds", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "checkpoints built: 1" in out.stdout
    assert "prefill and greedy tokens: [" in out.stdout
    assert "moeflux's CUDA runtime loaded: False" in out.stdout
