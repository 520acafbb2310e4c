"""Bad inputs and faults in the streaming path: each gets a specific exception naming the file,
layer or expert; no hang, no crash, no partial answer; the model stays usable after a fault.

docs/errors.md is the table these tests check, case by case.

Permissions: the tests run as root, which bypasses file modes, so the permission cases run in a
subprocess that imports everything as root and then drops to ``nobody`` with ``os.setuid``
before opening the checkpoint (skipped if there is no ``nobody`` user or we are not root).
SIGBUS-prone cases (mmap of a file truncated under it) also run in a subprocess, so a regression
kills the child, not the test session.
"""

from __future__ import annotations

import errno
import importlib
import itertools
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import moeflux_mlx
from moeflux_mlx.errors import (
    CheckpointError,
    ConvertError,
    ExpertFileError,
    ExpertIndexError,
    ExpertReadError,
    LayoutError,
    ModelClosedError,
    MoefluxError,
    SafetensorsHeaderError,
    UnsupportedQuantizationError,
)
from moeflux_mlx.options import LoadOptions, Tuning
from tests.support import synth

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 33, 2, 7, 100, 200, 17, 3]
N_TOKENS = 8
PACKED = "packed_experts"


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("reliability")
    src = synth.build_checkpoint(base / "src", "qwen3_moe", "tiny")
    dst = moeflux_mlx.convert(src, base / "dst", progress=False)
    return src, dst


@pytest.fixture(scope="module")
def reference(ckpt):
    """Greedy tokens of the undamaged model (the same for every I/O mode and cache)."""
    src, dst = ckpt
    model, _ = moeflux_mlx.load(dst, cache_budget=0)
    with model.moeflux:
        return gen(model)


def gen(model, n=N_TOKENS, prompt=PROMPT):
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(t) for (t, _), _ in zip(steps, range(n))]


def clone(path: Path, into: Path, name: str) -> Path:
    out = into / name
    shutil.copytree(path, out)
    return out


def edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def fault_preadv(monkeypatch, after: int, kind: str):
    """Make the ``after``-th and later ``os.preadv`` calls fail (``eio``, ``eof``: returns 0,
    ``kbi``: KeyboardInterrupt) or read at most half of what they are asked (``half``).

    The store's page-cache probes (``RWF_NOWAIT``, a flag) are neither counted nor failed: they
    read nothing that is used.

    Returns a function that removes the fault."""
    real = os.preadv
    calls = itertools.count()

    def fake(fd, buffers, offset, *args):
        if not args and next(calls) >= after:
            if kind == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            if kind == "eof":
                return 0
            if kind == "kbi":
                raise KeyboardInterrupt
            if kind == "half":
                view = memoryview(buffers[0])
                return real(fd, [view[: max(1, len(view) // 2)]], offset)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", fake)
    return lambda: monkeypatch.setattr(os, "preadv", real)


def count_preadv(monkeypatch, fn) -> int:
    real = os.preadv
    calls = itertools.count()

    def counting(*a):
        if len(a) == 3:  # reads, not the page-cache probes (fault_preadv's count)
            next(calls)
        return real(*a)

    monkeypatch.setattr(os, "preadv", counting)
    try:
        fn()
    finally:
        monkeypatch.setattr(os, "preadv", real)
    return next(calls)


def foreign_threads():
    """Live threads other than the main thread and the stores' read pools."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.name.startswith("moeflux-")
    )


def run_child(code: str, *args, timeout=120, user=None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, (
        f"child died with {proc.returncode} "
        f"(negative: killed by signal)\n{proc.stdout}\n{proc.stderr}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def dense_checkpoint(path: Path) -> Path:
    """A dense (not MoE) qwen3 checkpoint built with mlx-lm's own classes."""
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    cfg = dict(
        model_type="qwen3",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        vocab_size=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    mx.random.seed(0)
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.02, model.parameters()))
    model, cfg = quantize_model(model, cfg, 64, 4)
    save_model(path, model)
    save_config(cfg, path / "config.json")
    synth.build_tokenizer(path, 512)
    return path


# --------------------------------------------------------------------------- bad inputs
# (name, which directory it damages, damage, expected exception, words the message must contain)


def _missing_shard(d):
    def f(idx):
        name = sorted(idx["weight_map"])[0]
        idx["weight_map"][name] = "model-00002-of-00002.safetensors"

    edit_json(d / "model.safetensors.index.json", f)


def _damage_header(d):
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\xff\x00garbage{{{" * 4)


def _huge_header(d):
    with open(d / "model.safetensors", "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))


def _offsets_past_end(d):
    """A header whose last tensor's offsets point past the end of an intact-size file."""
    p = d / "model.safetensors"
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = max(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1]
    )
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [b + 4096, e + 4096]
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    new += b" " * (n - len(new))
    p.write_bytes(raw[:8] + new + raw[8 + n :])


def _set_quant(**kv):
    """config.json's own entries for layer 0's experts say ``kv`` (mlx-lm's loader follows a
    module's entry; without one it reads the quantization off the shapes, as moeflux does)."""

    def damage(d):
        def f(c):
            for key in ("quantization", "quantization_config"):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    entry = {"group_size": 64, "bits": 4, "mode": "affine", **kv}
                    c[key][f"model.layers.0.mlp.switch_mlp.{proj}"] = entry

        edit_json(d / "config.json", f)

    return damage


def _drop_quant(d):
    def f(c):
        c.pop("quantization")
        c.pop("quantization_config")

    edit_json(d / "config.json", f)


def _other_size_config(d):
    """config.json of another size of the same model (its moeflux section kept, if any)."""

    def f(c):
        other = synth.model_config("qwen3_moe", "small")
        for k in ("quantization", "quantization_config", "moeflux"):
            if k in c:
                other[k] = c[k]
        c.clear()
        c.update(other)

    edit_json(d / "config.json", f)


def _layers(n):
    return lambda d: edit_json(d / "config.json", lambda c: c.update(num_hidden_layers=n))


def _layout(fn):
    return lambda d: edit_json(d / PACKED / "layout.json", fn)


def _layout_and_config(fn):
    def damage(d):
        edit_json(d / PACKED / "layout.json", fn)
        edit_json(d / "config.json", lambda c: c.pop("moeflux"))

    return damage


def _del_components(layout):
    del layout["layers"]["0"]["components"]


def _more_experts(layout):
    layout["layers"]["0"]["num_experts"] *= 2


def _bits7(layout):
    layout["layers"]["1"]["quantization"]["bits"] = 7


BAD_INPUTS = [
    # converted directory
    (
        "missing_layer_file",
        "dst",
        lambda d: (d / PACKED / "layer_01.bin").unlink(),
        ExpertFileError,
        ["layer_01.bin", "missing", "layer 1"],
    ),
    (
        "truncated_layer_file",
        "dst",
        lambda d: truncate(
            d / PACKED / "layer_00.bin", (d / PACKED / "layer_00.bin").stat().st_size // 2
        ),
        ExpertFileError,
        ["layer_00.bin", "truncated", "layer 0"],
    ),
    (
        "empty_layer_file",
        "dst",
        lambda d: truncate(d / PACKED / "layer_01.bin", 0),
        ExpertFileError,
        ["layer_01.bin", "0 bytes"],
    ),
    (
        "oversized_layer_file",
        "dst",
        lambda d: open(d / PACKED / "layer_00.bin", "ab").write(b"\0" * 100),
        ExpertFileError,
        ["layer_00.bin", "wrong file or layout"],
    ),
    (
        "layout_json_corrupt",
        "dst",
        lambda d: (d / PACKED / "layout.json").write_text("{not json"),
        LayoutError,
        ["layout.json", "unreadable"],
    ),
    (
        "layout_json_binary",
        "dst",
        lambda d: (d / PACKED / "layout.json").write_bytes(bytes(range(256)) * 4),
        LayoutError,
        ["layout.json"],
    ),
    (
        "layout_json_wrong_version",
        "dst",
        _layout(lambda d: d.update(format_version=99)),
        LayoutError,
        ["layout.json", "format_version 99"],
    ),
    (
        "layout_json_missing",
        "dst",
        lambda d: (d / PACKED / "layout.json").unlink(),
        LayoutError,
        ["layout.json", "missing"],
    ),
    (
        "layout_json_malformed",
        "dst",
        _layout(_del_components),
        LayoutError,
        ["layout.json", "layer 0", "malformed"],
    ),
    (
        "layout_json_bad_bits",
        "dst",
        _layout(_bits7),
        UnsupportedQuantizationError,
        ["layout.json", "layer 1", "bits 7"],
    ),
    (
        "layout_vs_config",
        "dst",
        _layout(_more_experts),
        LayoutError,
        ["layout.json", "config.json", "different conversions"],
    ),
    (
        "layout_vs_files",
        "dst",
        _layout_and_config(_more_experts),
        # the layout's own checksums (one per expert it had) give the edit away first
        LayoutError,
        ["layout.json", "layer 0", "do not match its experts"],
    ),
    (
        "config_other_size_dst",
        "dst",
        _other_size_config,
        LayoutError,
        ["layer 0", "do not belong to this config"],
    ),
    ("config_fewer_layers_dst", "dst", _layers(1), LayoutError, ["layer 1", "no SwitchGLU"]),
    (
        "config_more_layers_dst",
        "dst",
        _layers(3),
        CheckpointError,
        ["layers.2", "checkpoint has none"],
    ),
    (
        "config_unreadable_dst",
        "dst",
        lambda d: (d / "config.json").write_text("{]"),
        CheckpointError,
        ["config.json", "unreadable"],
    ),
    (
        "dense_shard_header_dst",
        "dst",
        _damage_header,
        SafetensorsHeaderError,
        ["model.safetensors", "damaged"],
    ),
    (
        "dense_shard_truncated_dst",
        "dst",
        lambda d: truncate(
            d / "model.safetensors", (d / "model.safetensors").stat().st_size - 1000
        ),
        SafetensorsHeaderError,
        ["model.safetensors", "past the end of the file"],
    ),
    (
        "dense_shard_missing_dst",
        "dst",
        _missing_shard,
        CheckpointError,
        ["missing shards", "model-00002-of-00002.safetensors"],
    ),
    # plain mlx-lm checkpoint (load and convert)
    (
        "no_config",
        "src",
        lambda d: (d / "config.json").unlink(),
        CheckpointError,
        ["no config.json"],
    ),
    (
        "config_corrupt",
        "src",
        lambda d: (d / "config.json").write_text("not json"),
        CheckpointError,
        ["config.json", "unreadable"],
    ),
    (
        "missing_shard",
        "src",
        _missing_shard,
        CheckpointError,
        ["missing shards", "model-00002-of-00002.safetensors"],
    ),
    (
        "no_safetensors",
        "src",
        lambda d: (d / "model.safetensors").unlink(),
        CheckpointError,
        ["model.safetensors"],
    ),
    (
        "damaged_header",
        "src",
        _damage_header,
        SafetensorsHeaderError,
        ["model.safetensors", "damaged"],
    ),
    (
        "header_length_past_end",
        "src",
        _huge_header,
        SafetensorsHeaderError,
        ["model.safetensors", "past the end"],
    ),
    (
        "truncated_shard",
        "src",
        lambda d: truncate(
            d / "model.safetensors", (d / "model.safetensors").stat().st_size - 1000
        ),
        SafetensorsHeaderError,
        ["model.safetensors", "past the end of the file"],
    ),
    (
        "offsets_past_end",
        "src",
        _offsets_past_end,
        SafetensorsHeaderError,
        ["model.safetensors", "past the end of the file"],
    ),
    (
        "too_short_shard",
        "src",
        lambda d: truncate(d / "model.safetensors", 5),
        SafetensorsHeaderError,
        ["model.safetensors", "too short"],
    ),
    (
        "quant_bits_unsupported",
        "src",
        _set_quant(bits=7),
        UnsupportedQuantizationError,
        ["layer 0", "bits 7"],
    ),
    (
        "quant_mode_unsupported",
        "src",
        _set_quant(mode="nf4"),
        UnsupportedQuantizationError,
        ["layer 0", "'nf4'"],
    ),
    (
        "quant_bits_mismatch",
        "src",
        _set_quant(bits=8),
        UnsupportedQuantizationError,
        ["layer 0", "do not match"],
    ),
    (
        "quant_group_unsupported",
        "src",
        _set_quant(group_size=48),
        UnsupportedQuantizationError,
        ["layer 0", "group size 48"],
    ),
    (
        "quant_missing_in_config",
        "src",
        _drop_quant,
        UnsupportedQuantizationError,
        ["layer 0", "no quantization"],
    ),
    (
        "config_other_size_src",
        "src",
        _other_size_config,
        LayoutError,
        ["layer 0", "do not belong to this config"],
    ),
    ("config_fewer_layers_src", "src", _layers(1), LayoutError, ["layer 1", "no SwitchGLU"]),
    (
        "config_more_layers_src",
        "src",
        _layers(3),
        CheckpointError,
        ["layers.2", "checkpoint has none"],
    ),
    (
        "converted_without_layout",
        "dst_as_src",
        lambda d: (d / PACKED / "layout.json").unlink(),
        LayoutError,
        ["layout.json", "missing"],
    ),
]

# config mismatches are found while building the model: convert does not build one
CONVERT_SKIPS = {"config_other_size_src", "config_fewer_layers_src", "config_more_layers_src"}


@pytest.mark.parametrize("name,where,damage,exc,words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(ckpt, tmp_path, name, where, damage, exc, words):
    src, dst = ckpt
    d = clone(src if where == "src" else dst, tmp_path, "ckpt")
    damage(d)
    with pytest.raises(exc) as info:
        moeflux_mlx.load(d)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{name}: {w!r} not in {msg!r}"
    if where == "dst":
        return
    if name not in CONVERT_SKIPS:
        out = tmp_path / "out"
        with pytest.raises(exc) as info:
            moeflux_mlx.convert(d, out, progress=False)
        for w in words:
            assert w in str(info.value), f"{name} (convert): {w!r} not in {info.value}"
        assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_not_moe(tmp_path):
    d = dense_checkpoint(tmp_path / "dense")
    for call in (
        lambda: moeflux_mlx.load(d),
        lambda: moeflux_mlx.convert(d, tmp_path / "out", progress=False),
    ):
        with pytest.raises(CheckpointError, match="not an MoE checkpoint") as info:
            call()
        assert "qwen3" in str(info.value) and str(d) in str(info.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        moeflux_mlx.load(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not a directory"):
        moeflux_mlx.load(Path(__file__))


def test_convert_a_converted_directory(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="already a converted"):
        moeflux_mlx.convert(ckpt[1], tmp_path / "again", progress=False)


PERMISSION_CHILD = """
import json, os, pwd, sys
import moeflux_mlx, moeflux_mlx.model.load, mlx_lm.models.qwen3_moe  # all imported while still root
cases = json.loads(sys.argv[1])
nobody = pwd.getpwnam("nobody")
os.setgid(nobody.pw_gid)
os.setuid(nobody.pw_uid)
out = {}
for name, (entry, path) in cases.items():
    try:
        if entry == "load":
            moeflux_mlx.load(path)
        else:
            moeflux_mlx.convert(path, path + ".out", progress=False)
        out[name] = ["no error", ""]
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def test_unreadable_files(ckpt):
    """chmod 000 on each kind of file, opened as ``nobody``."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to nobody")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no nobody user")
    src, dst = ckpt
    base = Path(tempfile.mkdtemp(prefix="moeflux-perm-"))  # pytest's tmp dirs are 0700
    try:
        cases = {  # name: (entry, kind, file made unreadable, expected type, words)
            "layer_file": (
                "load",
                dst,
                f"{PACKED}/layer_01.bin",
                "ExpertFileError",
                ["layer_01.bin", "not readable", "layer 1"],
            ),
            "layout_json": (
                "load",
                dst,
                f"{PACKED}/layout.json",
                "LayoutError",
                ["layout.json", "Permission denied"],
            ),
            "config_json": (
                "load",
                dst,
                "config.json",
                "CheckpointError",
                ["config.json", "not readable"],
            ),
            "dense_shard": (
                "load",
                dst,
                "model.safetensors",
                "ExpertFileError",
                ["model.safetensors", "not readable"],
            ),
            "source_shard_load": (
                "load",
                src,
                "model.safetensors",
                "ExpertFileError",
                ["model.safetensors", "not readable"],
            ),
            "source_shard_convert": (
                "convert",
                src,
                "model.safetensors",
                "ExpertFileError",
                ["model.safetensors", "not readable"],
            ),
            "source_index_convert": (
                "convert",
                src,
                "model.safetensors.index.json",
                "CheckpointError",
                ["index.json", "not readable"],
            ),
        }
        args = {}
        for name, (entry, orig, rel, _, _) in cases.items():
            d = base / name
            shutil.copytree(orig, d)
            for p in [d, *d.rglob("*")]:
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
            os.chmod(d / rel, 0)
            args[name] = (entry, str(d))
        os.chmod(base, 0o755)
        got = run_child(PERMISSION_CHILD, json.dumps(args))
        for name, (_, _, _, exc, words) in cases.items():
            kind, msg = got[name]
            assert kind == exc, f"{name}: got {kind}: {msg}"
            for w in words:
                assert w in msg, f"{name}: {w!r} not in {msg!r}"
            assert not Path(args[name][1] + ".out").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------- expert indices


# The all-resident path passes indices to the kernels without a host sync, so it cannot check
# them; its range is guaranteed at load instead (the model's expert count must equal the files',
# see the "config from another model size" cases). Only the synced paths are checked per call.
@pytest.mark.parametrize("budget", [0, "0.4MB"], ids=["staging", "budget"])
def test_expert_index_out_of_range(ckpt, budget):
    """Calling a streaming module with an expert the layer does not have."""
    model, _ = moeflux_mlx.load(ckpt[1], cache_budget=budget)
    with model.moeflux:
        switch = model.model.layers[1].mlp.switch_mlp
        x = mx.zeros((1, 1, 128), mx.bfloat16)
        for bad, dtype in (
            ([0, 1, 2, 16], mx.uint32),
            ([0, 1, 2, 1 << 20], mx.uint32),
            ([0, -1, 2, 3], mx.int32),
        ):
            with pytest.raises(ExpertIndexError, match="layer 1: expert index") as info:
                mx.eval(switch(x, mx.array([[bad]], dtype)))
            assert "16 experts" in str(info.value)
        mx.eval(switch(x, mx.array([[[0, 1, 2, 15]]], mx.uint32)))  # still works


# --------------------------------------------------------------------------- faults mid-token


STREAMING = [
    ("pread", 0, 8, "transition"),
    ("pread", 0, 1, "transition"),
    ("pread", "0.4MB", 8, "transition"),
    ("pread", "0.4MB", 8, "lru"),
]
STREAMING_IDS = ["pread-threads", "pread-serial", "pread-cached", "pread-lru"]


def load_opts(threads: int, eviction: str = "transition") -> dict:
    """The read threads (the machine's choice, handed in as ``Tuning``) and the eviction."""
    return dict(options=LoadOptions(tuning=Tuning(threads=threads)), eviction=eviction)


@pytest.mark.parametrize("io,budget,threads,eviction", STREAMING, ids=STREAMING_IDS)
@pytest.mark.parametrize("kind,match", [("eio", "Input/output error"), ("eof", "short read")])
def test_read_fault_mid_generation(
    ckpt, reference, monkeypatch, io, budget, threads, eviction, kind, match
):
    """A disk error / short read in the middle of a token: the generation raises, nothing is
    returned, and once the fault is gone the same model generates the right tokens."""
    model, tok = moeflux_mlx.load(
        ckpt[1], expert_io=io, cache_budget=budget, **load_opts(threads, eviction)
    )
    with model.moeflux:
        total = count_preadv(monkeypatch, lambda: gen(model))
        assert total > 0
        restore = fault_preadv(monkeypatch, total // 2, kind)
        before = foreign_threads()
        with pytest.raises(ExpertReadError, match=match) as info:
            moeflux_mlx_generate(model, tok)
        assert "layer_0" in str(info.value) and "expert" in str(info.value)
        restore()
        assert foreign_threads() == before
        assert gen(model) == reference
        # and a fault at the very first read (prefill)
        restore = fault_preadv(monkeypatch, 0, kind)
        with pytest.raises(ExpertReadError):
            gen(model)
        restore()
        assert gen(model) == reference


def moeflux_mlx_generate(model, tok):
    """mlx_lm.generate: must raise, never return a partial answer."""
    import mlx_lm

    text = mlx_lm.generate(model, tok, prompt=PROMPT, max_tokens=N_TOKENS)
    raise AssertionError(f"a partial answer was returned: {text!r}")


def test_read_fault_plain_checkpoint(ckpt, reference, monkeypatch):
    """The same for experts read straight out of the mlx-lm safetensors."""
    model, _ = moeflux_mlx.load(ckpt[0], expert_io="pread", cache_budget=0)
    with model.moeflux:
        assert gen(model) == reference
        restore = fault_preadv(monkeypatch, 30, "eio")
        with pytest.raises(ExpertReadError, match="model.safetensors .*layer .*expert") as info:
            gen(model)
        assert "switch_mlp" not in str(info.value) or "proj" in str(info.value)
        restore()
        assert gen(model) == reference


@pytest.mark.parametrize("budget", [0, "0.4MB"], ids=["staging", "budget"])
def test_short_reads_are_retried(ckpt, reference, monkeypatch, budget):
    """A read that returns fewer bytes than asked (not 0) is continued, not an error."""
    model, _ = moeflux_mlx.load(ckpt[1], expert_io="pread", cache_budget=budget)
    with model.moeflux:
        restore = fault_preadv(monkeypatch, 0, "half")
        assert gen(model) == reference
        restore()


@pytest.mark.parametrize("expert_io", ["pread", "direct"])
def test_truncated_after_load_pread(ckpt, reference, tmp_path, expert_io):
    d = clone(ckpt[1], tmp_path, "dst")
    layer = d / PACKED / "layer_01.bin"
    original = layer.read_bytes()
    model, _ = moeflux_mlx.load(d, expert_io=expert_io, cache_budget=0)
    with model.moeflux:
        assert gen(model) == reference
        truncate(layer, len(original) // 3)
        with pytest.raises(
            ExpertReadError, match=r"layer_01.bin \(layer 1, expert \d+\).*short read"
        ):
            gen(model)
        layer.write_bytes(original)  # the fault is gone
        assert gen(model) == reference


MMAP_TRUNCATE_CHILD = """
import json, os, sys
import mlx.core as mx
from mlx_lm.generate import generate_step
import moeflux_mlx
path, victim, budget = sys.argv[1], sys.argv[2], sys.argv[3]
budget = 0 if budget == "0" else budget
prompt = mx.array(json.loads(sys.argv[4]))
def gen(m, n=8):
    return [int(t) for (t, _), _ in zip(generate_step(prompt, m, max_tokens=n), range(n))]
model, _ = moeflux_mlx.load(path, expert_io="mmap", cache_budget=budget)
out = {"io": model.moeflux.store.io_mode, "first": gen(model)}
original = open(victim, "rb").read()
os.truncate(victim, len(original) // 3)
try:
    gen(model)
    out["error"] = None
except Exception as e:
    out["error"] = [type(e).__name__, str(e)]
with open(victim, "r+b") as f:  # the fault is gone
    f.write(original)
out["after"] = gen(model)
model.moeflux.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("which", ["packed", "plain"])
def test_truncated_after_load_mmap_no_sigbus(ckpt, reference, tmp_path, which):
    """A mapped file truncated under a running model: SIGBUS would kill the process; the store
    checks the size before touching mapped pages and raises ExpertReadError instead."""
    if which == "packed":
        d = clone(ckpt[1], tmp_path, "dst")
        victim = d / PACKED / "layer_00.bin"
    else:
        d = clone(ckpt[0], tmp_path, "src")
        victim = d / "model.safetensors"
    got = run_child(MMAP_TRUNCATE_CHILD, d, victim, 0, json.dumps(PROMPT))
    assert got["io"] == "mmap"
    assert got["first"] == reference
    assert got["error"] is not None, "no error after truncation"
    kind, msg = got["error"]
    assert kind == "ExpertReadError", msg
    assert victim.name in msg and "shrank" in msg and "layer 0" in msg
    assert got["after"] == reference


# --------------------------------------------------------------------------- interrupts


@pytest.mark.parametrize(
    "budget,threads,eviction",
    [(0, 8, "transition"), ("0.4MB", 8, "transition"), (0, 1, "transition"), ("0.4MB", 8, "lru")],
    ids=["staging-threads", "cached-threads", "staging-serial", "lru-threads"],
)
def test_keyboard_interrupt_inside_a_read(ckpt, reference, monkeypatch, budget, threads, eviction):
    """KeyboardInterrupt raised from inside a read (a worker thread for threads > 1)."""
    model, _ = moeflux_mlx.load(
        ckpt[1], expert_io="pread", cache_budget=budget, **load_opts(threads, eviction)
    )
    with model.moeflux:
        before = foreign_threads()
        for after in (0, 5, 15, 30):
            restore = fault_preadv(monkeypatch, after, "kbi")
            with pytest.raises(KeyboardInterrupt):
                gen(model, 64)
            restore()
            assert foreign_threads() == before
            pool = [t for t in threading.enumerate() if t.name.startswith("moeflux-")]
            assert len(pool) <= 12 * 8  # bounded by the pools of the models alive in this session
            assert gen(model) == reference


def _small_shares(monkeypatch, ckpt):
    """A pread store of three read threads whose calls split into shares of a few 4 KiB
    pieces each (the tiny experts would otherwise make one share), and its layer 0."""
    from moeflux_mlx.io import store as st

    monkeypatch.setattr(st, "MIN_SHARE_BYTES", 4096)
    monkeypatch.setattr(st, "READ_PIECE_BYTES", 4096)
    store, layout = st.open_store(ckpt[1], "pread", threads=3)
    layer = min(layout.layers)
    data = np.fromfile(store.layers[layer].path, np.uint8).reshape(
        layout.layers[layer].num_experts, -1
    )
    return store, layer, data


def test_a_failed_piece_fails_the_call_after_the_other_shares_finish(ckpt, monkeypatch):
    from moeflux_mlx.format import readers

    store, layer, data = _small_shares(monkeypatch, ckpt)
    experts = np.array([0, 1, 2])
    bad = int(experts[1]) * data.shape[1]  # the first byte of the second expert
    real = readers.read_exact

    def read_exact(fd, at, into, what):
        if at == bad:
            raise ExpertReadError(f"{what}: injected")
        real(fd, at, into, what)

    monkeypatch.setattr(readers, "read_exact", read_exact)
    with store:
        out = np.zeros((3, data.shape[1]), np.uint8)
        with pytest.raises(ExpertReadError, match="injected"):
            store.read(layer, experts, out)
        # the shares that held neither the failed piece nor what followed it in its share
        assert np.array_equal(out[0], data[0]) and np.array_equal(out[2], data[2])
        monkeypatch.setattr(readers, "read_exact", real)
        assert np.array_equal(store.read(layer, experts), data[:3])  # the next call reads again


def test_interrupt_stops_the_shares_under_way(ckpt, monkeypatch):
    """Ctrl-C while a call waits: shares under way stop at their next piece, and none is still
    writing when the interrupt reaches the caller."""
    import signal
    import time

    from moeflux_mlx.format import readers

    store, layer, data = _small_shares(monkeypatch, ckpt)
    real, reads, running = readers.read_exact, [], []

    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
    once = threading.Lock()

    def slow(fd, at, into, what):
        if once.acquire(blocking=False):
            timer.start()  # Ctrl-C 50 ms after the first read begins: 2-3 of 7 pieces a share
        running.append(1)
        time.sleep(0.02)
        real(fd, at, into, what)
        reads.append(at)
        running.pop()

    monkeypatch.setattr(readers, "read_exact", slow)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with store:
            experts = np.arange(3)
            with pytest.raises(KeyboardInterrupt):
                store.read(layer, experts, np.zeros((3, data.shape[1]), np.uint8))
            assert not running  # nothing writes after the call has returned
            assert len(reads) < 3 * -(-data.shape[1] // 4096)  # not every piece was read
            monkeypatch.setattr(readers, "read_exact", real)
            assert np.array_equal(store.read(layer, experts), data[:3])
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, handler)


SIGINT_CHILD = """
import json, os, random, signal, sys, threading, time
import mlx.core as mx
from mlx_lm.generate import generate_step
import moeflux_mlx
# Ctrl-C as in a terminal, even when the test runner ignores SIGINT (a shell's background job
# does, and exec keeps it ignored: the endless generations below would never end)
signal.signal(signal.SIGINT, signal.default_int_handler)
path, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = mx.array(json.loads(sys.argv[4]))
def gen(m, n=8):
    return [int(t) for (t, _), _ in zip(generate_step(prompt, m, max_tokens=n), range(n))]
rng = random.Random(seed)
report = {}
configs = [("pread-staging", "pread", 0, {}), ("mmap-staging", "mmap", 0, {}),
           ("pread-cached", "pread", "0.4MB", {}), ("mmap-cached", "mmap", "0.4MB", {}),
           ("pread-lru", "pread", "0.4MB", {"eviction": "lru"})]
for name, io, budget, opts in configs:
    model, _ = moeflux_mlx.load(path, expert_io=io, cache_budget=budget, **opts)
    ref = gen(model)
    res = {"ref": ref, "interrupted": 0, "bad": [], "threads": []}
    for i in range(trials):
        delay = rng.uniform(0.0, 0.25)
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        tokens = 0
        try:
            timer.start()
            for _ in generate_step(prompt, model, max_tokens=10**6):
                tokens += 1
        except KeyboardInterrupt:
            res["interrupted"] += 1
        timer.join()
        names = sorted(t.name for t in threading.enumerate()
                       if t is not threading.main_thread() and not t.name.startswith("moeflux-"))
        if names:
            res["threads"].append(names)
        again = gen(model)
        if again != ref:
            res["bad"].append([i, round(delay, 4), tokens, again])
    model.moeflux.close()
    res["pool_after_close"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("moeflux-"))
    report[name] = res
print(json.dumps(report))
"""


def test_sigint_mid_generation(ckpt, reference):
    """Real SIGINTs (os.kill from a timer thread) at random points of endless generations, in a
    fresh process: each interrupt leaves no thread but the read pool, and the next generation
    gives exactly the reference tokens."""
    trials = 10
    got = run_child(SIGINT_CHILD, ckpt[1], trials, 1234, json.dumps(PROMPT), timeout=240)
    for name, res in got.items():
        assert res["ref"] == reference, name
        assert res["interrupted"] == trials, name
        assert res["threads"] == [], (name, res["threads"])
        assert res["pool_after_close"] == [], name
        assert res["bad"] == [], (name, res["bad"])


# --------------------------------------------------------------------------- closed model


def test_closed_model(ckpt):
    model, _ = moeflux_mlx.load(ckpt[1], cache_budget=0)
    gen(model, 2)
    model.moeflux.close()
    model.moeflux.close()  # idempotent
    with pytest.raises(ModelClosedError, match="closed"):
        gen(model, 2)
    with pytest.raises(ModelClosedError):
        model.moeflux.store.read(0, np.array([0]))


# --------------------------------------------------------------------------- convert faults


def _tree(path: Path) -> dict:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_convert_read_error_then_resume(ckpt, tmp_path, monkeypatch):
    src = clone(ckpt[0], tmp_path, "src")
    before = _tree(src)
    out = tmp_path / "out"
    restore = fault_preadv(monkeypatch, 20, "eio")
    with pytest.raises(ExpertReadError, match="model.safetensors"):
        moeflux_mlx.convert(src, out, progress=False)
    restore()
    assert not out.exists()
    assert (tmp_path / "out.partial").is_dir()  # kept for the rerun
    moeflux_mlx.convert(src, out, verify=True, progress=False)
    assert not (tmp_path / "out.partial").exists()
    assert _tree(src) == before


def test_convert_write_error(ckpt, tmp_path, monkeypatch):
    """Disk full while writing: ConvertError naming DST and the partial directory."""
    src, out = ckpt[0], tmp_path / "out"
    real, calls = os.replace, itertools.count()

    def full(a, b, *args, **kw):
        if next(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(b))
        return real(a, b, *args, **kw)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(ConvertError, match="No space left on device") as info:
        moeflux_mlx.convert(src, out, progress=False)
    assert "out.partial" in str(info.value) and "was not created" in str(info.value)
    monkeypatch.setattr(os, "replace", real)
    assert not out.exists()
    moeflux_mlx.convert(src, out, verify=True, progress=False)


def test_convert_keyboard_interrupt(ckpt, tmp_path, monkeypatch):
    src, out = ckpt[0], tmp_path / "out"
    restore = fault_preadv(monkeypatch, 25, "kbi")
    with pytest.raises(KeyboardInterrupt):
        moeflux_mlx.convert(src, out, progress=False)
    restore()
    assert not out.exists()
    moeflux_mlx.convert(src, out, verify=True, progress=False)


def test_convert_verify_failure(ckpt, tmp_path, monkeypatch):
    """Bytes that do not verify: ConvertError, no DST, and no partial directory to resume from."""
    conv = importlib.import_module("moeflux_mlx.format.convert")  # the attribute is the function

    src, out = ckpt[0], tmp_path / "out"
    real = conv._write_layer

    def corrupt(ckpt_, layer, layout, path, bar):
        sums = real(ckpt_, layer, layout, path, bar)  # what convert meant to write
        if layer == 1:
            with open(path, "r+b") as f:
                f.seek(layout.blob_size * 3 + 10)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
        return sums

    monkeypatch.setattr(conv, "_write_layer", corrupt)
    with pytest.raises(ConvertError, match=r"layer_01.bin: expert 3 \(gate_proj.weight\) differs"):
        moeflux_mlx.convert(src, out, verify=True, progress=False)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_convert_destination_exists(ckpt, tmp_path):
    src = ckpt[0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")  # a directory with something in it is never touched
    with pytest.raises(ConvertError, match="already exists"):
        moeflux_mlx.convert(src, out, progress=False)
    shutil.rmtree(out)
    out.mkdir()  # an empty one is taken
    moeflux_mlx.convert(src, out, progress=False)
    before = _tree(out)
    # a finished conversion of the same source: nothing to do, nothing touched
    assert moeflux_mlx.convert(src, out, progress=False) == out and _tree(out) == before


def test_every_error_is_a_moeflux_error():
    for exc in (
        CheckpointError,
        SafetensorsHeaderError,
        UnsupportedQuantizationError,
        LayoutError,
        ExpertFileError,
        ExpertReadError,
        ExpertIndexError,
        ModelClosedError,
        ConvertError,
    ):
        assert issubclass(exc, MoefluxError)
    assert issubclass(ExpertReadError, OSError) and issubclass(ExpertFileError, OSError)
    assert issubclass(CheckpointError, ValueError) and issubclass(ExpertIndexError, IndexError)
