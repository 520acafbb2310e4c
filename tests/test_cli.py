"""The ``moeflux-mlx`` commands, run as ``main(argv)`` (and once as a subprocess)."""

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeflux_mlx import cli
from moeflux_mlx.commands import common, compare
from moeflux_mlx.format.checkpoint import PACKED_DIR
from moeflux_mlx.format.convert import convert
from tests.support import synth

REPO = Path(__file__).resolve().parents[1]
STATS = re.compile(
    r"\[prompt: (\d+) tokens.*\| reply: (\d+) tokens, [\d.]+ tok/s \| peak memory "
    r".* \| experts: .* read, (?:.* all resident, )?(hit rate [\d.]+%|every expert resident)"
)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """arch -> plain tiny mlx-lm checkpoint (seed 0), built once for this module."""
    root = tmp_path_factory.mktemp("cli")
    return {arch: synth.build_checkpoint(root / arch, arch, "tiny") for arch in synth.ARCHITECTURES}


@pytest.fixture(scope="module")
def packed(ckpts, tmp_path_factory):
    return convert(
        ckpts["qwen3_moe"], tmp_path_factory.mktemp("cli-packed") / "qwen3_moe", progress=False
    )


@pytest.fixture(autouse=True)
def _keep_log_level():
    logger = logging.getLogger("moeflux_mlx")
    level = logger.level
    yield
    logger.setLevel(level)


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert lines and lines[-1].startswith("moeflux-mlx: error: ")
    return lines[-1]


# --------------------------------------------------------------------------- compare


@pytest.mark.parametrize("arch", synth.ARCHITECTURES)
def test_compare_is_exact_on_cpu(arch, ckpts, capsys):
    rc = cli.main(["compare", str(ckpts[arch]), "--max-tokens", "12"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Result: SAME (required: exact (CPU))" in out
    total = re.search(r"^all\s+(\d+)/(\d+)\s+-\s+0\s", out, re.M)
    assert total and total[1] == total[2] and int(total[2]) >= 3, out
    same = re.findall(r"^\S.*\s(\d+)/\1\s+-\s+0\s", out, re.M)
    assert len(same) == len(compare.DEFAULT_PROMPTS) + 1


def test_compare_fails_on_different_experts(ckpts, packed, tmp_path, capsys):
    """The moeflux side reads another seed's experts (dense weights unchanged): must exit 1."""
    other = synth.build_checkpoint(tmp_path / "seed1", "qwen3_moe", "tiny", seed=1)
    other_packed = convert(other, tmp_path / "seed1-packed", progress=False)
    tampered = tmp_path / "tampered"
    shutil.copytree(packed, tampered)
    # the other experts with their layout.json (its recorded checksums), so that they are read
    # as a sound conversion, only of other weights
    for f in (other_packed / PACKED_DIR).glob("layer_*.bin"):
        shutil.copy(f, tampered / PACKED_DIR / f.name)
    shutil.copy(other_packed / PACKED_DIR / "layout.json", tampered / PACKED_DIR / "layout.json")

    rc = cli.main(["compare", str(ckpts["qwen3_moe"]), "--converted", str(tampered), "-m", "8"])
    out = capsys.readouterr().out
    assert rc == compare.EXIT_DIFFERENT, out
    assert "Result: DIFFERENT" in out
    # ... and the untouched converted directory passes, so the failure is the experts' doing.
    rc = cli.main(["compare", str(ckpts["qwen3_moe"]), "--converted", str(packed), "-m", "8"])
    assert rc == 0


def test_compare_says_each_prompt_as_it_starts(ckpts, capsys):
    """A status line per prompt and side on stderr: a slow model is not silent for minutes."""
    rc = cli.main(["compare", str(ckpts["qwen3_moe"]), "-p", "one", "-p", "two", "-m", "3"])
    err = capsys.readouterr().err
    assert rc == 0, err
    for side in ("stock mlx-lm", "moeflux-mlx"):
        for i in (1, 2):
            assert re.search(
                rf"^{side}: prompt {i}/2 \(\d+ tokens, up to 3 more\) \.\.\.$", err, re.M
            ), err


def test_compare_float32_rule_applies():
    """Off the CPU: moeflux's mean KL from float32 against stock's, tokens or not identical."""
    stock = np.array([0.01, 0.03, 0.0])
    below, above = compare.FLOAT32_FACTOR - 0.1, compare.FLOAT32_FACTOR + 0.1
    rows = [compare.Row("p", 1, 3, 1, 2.5, 1.0, 1.0, "", stock, stock * below)]
    report = compare.Report(Path("m"), Path("m"), rows, True, False, "gpu")
    assert report.passed  # tokens parted at a near tie, yet as close to float32 as stock
    text = compare.format_report(report)
    rule = f"Result: SAME (required: moeflux's mean KL to f32 <= {compare.FLOAT32_FACTOR:g} x"
    assert rule in text, text
    rows[0].moeflux_kl = stock * above
    assert not report.passed
    assert "Result: DIFFERENT" in compare.format_report(report)
    rows[0].moeflux_kl = np.array([0.0, 0.0, np.inf])  # a NaN at one position
    assert not report.passed
    # where stock (or the reference) gives NaN, that position says nothing of moeflux
    rows[0].stock_kl = np.array([0.01, np.inf, 0.0])
    rows[0].moeflux_kl = np.array([0.012, 9.0, 0.0])
    assert report.passed
    rows[0].stock_kl = np.full(3, np.inf)
    assert not report.judged and not report.passed
    assert "Result: NOT COMPARED" in compare.format_report(report)
    # a float32 checkpoint: stock is its own reference; the floor admits float32 rounding
    assert compare.passes_float32_rule(np.zeros(4), np.full(4, 1e-7))
    assert not compare.passes_float32_rule(np.zeros(4), np.full(4, 1e-3))


def test_kl_divergence_of_log_prob_vectors():
    with np.errstate(divide="ignore"):  # log(0) = -inf, as log-softmax gives a masked token
        ref = np.log(np.array([0.5, 0.5, 0.0], np.float32))
        got = np.log(np.array([0.25, 0.75, 0.0], np.float32))
        none = np.log(np.array([1.0, 0.0, 0.0]))
    assert compare.kl_divergence(ref, ref) == 0.0
    want = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
    assert abs(compare.kl_divergence(ref, got) - want) < 1e-6
    assert compare.kl_divergence(ref, none) == np.inf
    assert compare.kl_divergence(ref, np.full(3, np.nan)) == np.inf


def test_compare_does_not_run_stock_when_it_does_not_fit(ckpts, monkeypatch, capsys):
    monkeypatch.setattr(compare, "available_memory", lambda: 1000)
    rc = cli.main(["compare", str(ckpts["qwen3_moe"]), "-m", "4"])
    out, err = capsys.readouterr()
    assert rc == compare.EXIT_NOT_COMPARED
    assert "not running it" in err and "--force" in err
    assert "NOT COMPARED" in out
    assert cli.main(["compare", str(ckpts["qwen3_moe"]), "-m", "4", "--force"]) == 0


def test_compare_rejects_a_converted_model(packed, capsys):
    assert cli.main(["compare", str(packed)]) == 2
    assert "--converted" in _one_line_error(capsys.readouterr().err)


# --------------------------------------------------------------------------- info, convert


def test_info_plain_and_converted(ckpts, packed, capsys):
    assert cli.main(["info", str(ckpts["qwen3_moe"])]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(.+?)\s{2,}(.*)$", out, re.M))
    assert rows["model_type"] == "qwen3_moe"
    assert rows["layers"] == "2, of which 2 MoE (0-1)"
    assert rows["experts per layer"] == "16" and rows["top-k"] == "4"
    assert rows["expert quantization"] == "4-bit affine, group 64"
    assert rows["format"].startswith("mlx-lm checkpoint")
    blob = int(rows["expert blob"].split()[0].replace(",", ""))
    total = int(re.search(r"\(([\d,]+) bytes\)", rows["experts, total"])[1].replace(",", ""))
    assert total == 2 * 16 * blob
    assert re.fullmatch(r"mmap \(auto: experts .* MB <= 0\.75 x RAM .* GB\)", rows["expert I/O"])
    assert rows["backend"].startswith("ops (auto, device cpu)")
    assert "total" in rows["RAM"] and "available" in rows["RAM"]

    assert cli.main(["info", str(packed), "--expert-io", "pread"]) == 0
    rows = dict(re.findall(r"^(.+?)\s{2,}(.*)$", capsys.readouterr().out, re.M))
    assert rows["format"].startswith("converted")
    assert rows["expert blob"] == f"{blob:,} bytes"
    assert rows["expert I/O"] == "pread (requested: --expert-io pread)"


def test_load_options_reach_load(packed, capsys):
    assert cli.main(["info", str(packed), "--cache-budget", "0"]) == 0
    rows = dict(re.findall(r"^(.+?)\s{2,}(.*)$", capsys.readouterr().out, re.M))
    assert rows["expert cache"].startswith("0 B of MLX memory")
    with pytest.raises(SystemExit) as e:
        cli.main(["info", str(packed), "--cache-budget", "lots"])
    assert e.value.code == 2 and "--cache-budget" in capsys.readouterr().err

    args = cli.build_parser().parse_args(
        [
            "chat",
            "--expert-io",
            "pread",
            "--cache-budget",
            "1GB",
            "--backend",
            "ops",
        ]
    )
    assert common.load_kwargs(args) == {
        "expert_io": "pread",
        "cache_budget": "1GB",
        "backend": "ops",
    }
    assert common.load_kwargs(cli.build_parser().parse_args(["generate"])) == {}
    args = cli.build_parser().parse_args(["generate", "--eviction", "lru", "--pin-experts"])
    assert common.load_kwargs(args) == {"eviction": "lru", "pin_experts": True}
    # what the machine decides is no flag: the removed ones are refused, not ignored
    for gone in (["--threads", "3"], ["--device-table"], ["--no-device-table"], ["--prefetch"]):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(["generate", *gone])
        assert e.value.code == 2 and gone[0] in capsys.readouterr().err


def test_info_names_each_architecture(ckpts, capsys):
    for arch in synth.ARCHITECTURES:
        assert cli.main(["info", str(ckpts[arch])]) == 0
        out = capsys.readouterr().out
        assert re.search(rf"^model_type\s+{arch}\b", out, re.M), out
    # deepseek_v3's first layer is dense: one more layer than MoE layers
    assert cli.main(["info", str(ckpts["deepseek_v3"])]) == 0
    assert re.search(r"^layers\s+3, of which 2 MoE \(1-2\)", capsys.readouterr().out, re.M)


def test_convert_and_verify(ckpts, tmp_path, capsys):
    dst = tmp_path / "out"
    assert cli.main(["convert", str(ckpts["mixtral"]), str(dst), "--verify", "-q"]) == 0
    out = capsys.readouterr().out
    assert "(verified byte for byte)" in out and "2 MoE layers" in out
    assert sorted(p.name for p in (dst / PACKED_DIR).iterdir()) == [
        "layer_00.bin",
        "layer_01.bin",
        "layout.json",
    ]
    # another model onto the same destination: refused in one line
    assert cli.main(["convert", str(ckpts["qwen3_moe"]), str(dst), "-q"]) == 2
    assert "already exists" in _one_line_error(capsys.readouterr().err)


def test_convert_of_a_non_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    assert cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    assert "config.json" in _one_line_error(capsys.readouterr().err)


# --------------------------------------------------------------------------- generate, demo


def test_generate(packed, capsys):
    rc = cli.main(
        [
            "generate",
            "--model",
            str(packed),
            "--prompt",
            "hello",
            "-m",
            "10",
            "--expert-io",
            "pread",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.strip()
    m = STATS.search(err)
    assert m and int(m[2]) <= 10, err
    assert "(pread)" in err  # the expert I/O option reached moeflux_mlx.load


def test_generate_sampling_is_seeded(packed, capsys):
    args = [
        "generate",
        "--model",
        str(packed),
        "-p",
        "hi",
        "-m",
        "12",
        "--temp",
        "1.0",
        "--top-p",
        "0.9",
    ]
    texts = []
    for seed in ("1", "1", "2"):
        assert cli.main(args + ["--seed", seed]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2]


def test_generate_missing_model_is_one_line(tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "nope"), "-m", "2"]) == 2
    assert "nope" in _one_line_error(capsys.readouterr().err)


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--bogus"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_module_entry_point_verbose_logs_ram_gate(packed):
    """``python -m moeflux_mlx.cli`` works without the console script; --verbose logs at INFO."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeflux_mlx.cli",
            "generate",
            "--model",
            str(packed),
            "-p",
            "hi",
            "-m",
            "4",
            "--verbose",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"INFO moeflux_mlx\.io\.store: expert I/O: mmap \(", r.stderr), r.stderr
    assert STATS.search(r.stderr)
    quiet = subprocess.run(
        [sys.executable, "-m", "moeflux_mlx.cli", "info", str(packed)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert quiet.returncode == 0 and "INFO" not in quiet.stderr
