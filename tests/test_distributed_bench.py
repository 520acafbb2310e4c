"""``benchmarks/distributed.py``: one process, a pipeline and tensor parallelism launched in one
run, compared and reported; here on the CPU over the ring backend (the two-GPU figures: docs/
distributed.md). The ranks' environment is what ``mlx.launch`` gives them, with a GPU each."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib.distributed import rank_env
from moeflux_mlx.measure import machine_tag

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "distributed.py"
TRACE = ROOT / "benchmarks" / "results" / "traces" / "2026-11-25-trained-text.npz"


def test_each_rank_gets_its_launch_and_its_own_gpu(tmp_path):
    base = {"MLX_RANK": "7", "NCCL_PORT": "1", "MLX_PTX_CACHE_DIR": "/keep", "PATH": "/bin"}
    ring = [rank_env(r, 2, "ring", tmp_path, gpus=2, base=base) for r in range(2)]
    assert [e["MLX_RANK"] for e in ring] == ["0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in ring] == ["0", "1"]
    assert ring[0]["MLX_HOSTFILE"] == ring[1]["MLX_HOSTFILE"]
    hosts = json.loads(Path(ring[0]["MLX_HOSTFILE"]).read_text())
    assert len(hosts) == 2 and all(h[0].startswith("127.0.0.1:") for h in hosts)
    assert "NCCL_PORT" not in ring[0] and ring[0]["MLX_PTX_CACHE_DIR"] == "/keep"
    nccl = [rank_env(r, 2, "nccl", tmp_path, gpus=2, base=base) for r in range(2)]
    assert nccl[0]["NCCL_PORT"] == nccl[1]["NCCL_PORT"] != "1"
    assert nccl[1]["MLX_WORLD_SIZE"] == "2" and nccl[1]["NCCL_NVLS_ENABLE"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in rank_env(1, 2, "ring", tmp_path, gpus=1, base=base)
    with pytest.raises(ValueError, match="jaccl"):
        rank_env(0, 2, "jaccl", tmp_path, base=base)


def test_machine_tags_name_the_gpus():
    assert machine_tag("NVIDIA H100 80GB HBM3, x86_64 16 cores 126 GiB") == "h100"
    assert machine_tag("2 x NVIDIA H200, x86_64 32 cores 251 GiB") == "h200x2"


def test_the_benchmark_checks_and_reports_every_layout(tmp_path):
    """A 4-layer model whose routers replay the trained trace: the pipeline's stages replay what
    their layers replay in one process (else its tokens would differ), its tokens and log-probs
    are one process's, tensor parallelism's (ops) are stock ``sharded_load``'s."""
    out = tmp_path / "results"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--layers",
            "4",
            "--set",
            "num_experts=64",
            "--set",
            "num_experts_per_tok=8",
            "--routing-trace",
            str(TRACE),
            "--prompt-tokens",
            "16",
            "--decode-tokens",
            "6",
            "--build-dir",
            str(tmp_path / "models"),
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--machine",
            "test",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (result,) = [json.loads(f.read_text()) for f in out.glob("*-test-distributed.json")]
    assert {k: v["rc"] for k, v in result["jobs"].items()} == {
        "single": [0],
        "pipeline": [0, 0],
        "tensor": [0, 0],
    }
    checks = {c["what"].split(":")[0]: c["ok"] for c in result["checks"]}
    assert checks == {
        "pipeline moeflux, warm": True,
        "pipeline moeflux, cold": True,
        "pipeline moeflux resident, warm": True,
        "tensor parallel moeflux ops": True,
        "tensor parallel moeflux": None,  # reported only: fused kernels round otherwise
    }
    rows = {(r["job"], r["step"], r["phase"]): r for r in result["rows"]}
    pipe = rows[("pipeline", "moeflux", "cold")]
    assert pipe["x_one_process"] > 0 and len(pipe["mb_read_per_token"]) == 2
    # each stage holds its own two layers' experts; a tensor-parallel rank half of every one
    shares = result["raw"]["pipeline"][0]["steps"]["moeflux"]["share"]
    whole = result["raw"]["single"][0]["steps"]["moeflux"]["share"]
    assert shares["layers"] == [2, 3] and whole["layers"] == [0, 1, 2, 3]
    tp = result["raw"]["tensor"][1]["steps"]["moeflux"]["share"]
    assert tp["mb"] == pytest.approx(whole["mb"] / 2, rel=0.05)
    assert shares["budget_mb"] == whole["budget_mb"]  # the same budget per process
    (md,) = [f.read_text() for f in out.glob("*-test-distributed.md")]
    assert "Checks:" in md and "- identical: tensor parallel moeflux ops" in md
    assert "| pipeline | 2 | moeflux | cold |" in run.stdout
    assert "MISMATCH" not in run.stdout


def test_bad_input_is_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--routing-trace", str(tmp_path / "none.npz")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "none.npz: no such file" in run.stderr and "Traceback" not in run.stderr
