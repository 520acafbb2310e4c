"""The built-in demo model: shipped in the package (and in a wheel built from the repo), the
default of the commands, and streamed exactly as stock mlx-lm runs it."""

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

import moeflux_mlx
from moeflux_mlx import cli, demo_model
from moeflux_mlx.errors import CheckpointError

REPO = Path(__file__).resolve().parents[1]
MAX_BYTES = 48 * 10**6  # what a repository can carry comfortably


def test_checkpoint_is_a_small_trained_qwen3_moe():
    path = demo_model.checkpoint_path()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert (config["num_experts"], config["num_experts_per_tok"]) == (64, 8)
    assert config["quantization"]["bits"] == 4
    assert sum(f.stat().st_size for f in path.iterdir()) <= MAX_BYTES
    # trained, not random: its held-out bits per character are recorded beside it
    assert json.loads((path / "eval-valid.json").read_text())["bpc"] < 2.0


def _greedy(model, prompt, n):
    out = []
    for (tok, logprobs), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        out.append((int(tok), logprobs))
    return out


def test_streamed_demo_matches_stock_mlx_lm_exactly():
    path = demo_model.checkpoint_path()
    stock, tokenizer = mlx_load(str(path))
    streamed, _ = moeflux_mlx.load(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me something wise."}], add_generation_prompt=True
    )
    ref, got = _greedy(stock, prompt, 12), _greedy(streamed, prompt, 12)
    assert [t for t, _ in got] == [t for t, _ in ref]
    for (_, a), (_, b) in zip(ref, got):
        assert mx.array_equal(a, b)
    # it speaks: the reply decodes to words, not to byte soup
    text = tokenizer.decode([t for t, _ in ref])
    assert re.search(r"[A-Za-z]{3,} [A-Za-z]{2,}", text), text


def test_demo_command_uses_it_and_prints_its_path(capsys):
    assert cli.main(["demo", "-m", "6"]) == 0
    out, err = capsys.readouterr()
    assert "using the built-in demo model" in err and str(demo_model.checkpoint_path()) in err
    assert out.strip()
    assert cli.main(["demo", "--path"]) == 0
    assert capsys.readouterr().out.strip() == str(demo_model.checkpoint_path())


def test_incomplete_install_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(demo_model, "_CHECKPOINT", tmp_path)
    with pytest.raises(CheckpointError, match="missing model.safetensors"):
        demo_model.checkpoint_path()


@pytest.mark.slow
def test_wheel_carries_the_checkpoint(tmp_path):
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("moeflux_mlx-*.whl")
    with zipfile.ZipFile(wheel) as z:
        sizes = {i.filename: i.file_size for i in z.infolist()}
    shipped = demo_model.checkpoint_path()
    for f in shipped.iterdir():
        assert sizes.get(f"moeflux_mlx/demo_model/checkpoint/{f.name}") == f.stat().st_size, f.name


def test_compare_on_the_demo_is_same_and_shows_the_replies(capsys):
    assert cli.main(["compare", "-m", "12"]) == 0
    out = capsys.readouterr().out
    assert "Result: SAME" in out
    replies = [ln for ln in out.splitlines() if ln.startswith("moeflux's reply to")]
    assert len(replies) == 3
    assert all(re.search(r"[A-Za-z]{3,} [A-Za-z]{2,}", ln.split(": ", 1)[1]) for ln in replies)
