"""Every packed expert equals the source slices byte for byte; bounded memory; crash-safe
staging; clear errors."""

import hashlib
import importlib
import json
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from moeflux_mlx.errors import CheckpointError
from moeflux_mlx.format.checkpoint import EXPERT_KEY, packed_file, packed_layout, scan_checkpoint
from moeflux_mlx.format.convert import ConvertError, convert, verify_conversion
from moeflux_mlx.format.layout import ModelLayout
from tests.support import synth


def _bytes(a: mx.array) -> np.ndarray:
    """The raw bytes of an MLX array (bf16 has no numpy dtype, so view it as integers)."""
    view = {2: mx.uint16, 4: mx.uint32, 1: mx.uint8}[a.dtype.size]
    return np.array(a.view(view)).view(np.uint8).reshape(a.shape[0], -1)


def _stacked(name, weights) -> bool:
    """A routed expert's tensor: a projection of a module whose weights are stacked (3-D)."""
    m = EXPERT_KEY.match(name)
    return m is not None and weights[f"{m['module']}.{m['projection']}.weight"].ndim == 3


def _tree_hash(path):
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("arch", synth.ARCHITECTURES)
def test_packed_experts_equal_source_slices(tiny_checkpoints, arch):
    src, dst = tiny_checkpoints[arch]
    layout = packed_layout(dst)
    assert layout.to_dict() == scan_checkpoint(src).layout.to_dict()
    weights = {}
    for f in sorted(src.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    experts = {k: v for k, v in weights.items() if _stacked(k, weights)}
    assert experts, "the synthetic checkpoint has stacked experts"
    checked = 0
    for layer, lay in layout.layers.items():
        blob = np.fromfile(packed_file(dst, layer), np.uint8).reshape(
            lay.num_experts, lay.blob_size
        )
        module = layout.module_paths[layer]
        for c in lay.components:
            want = _bytes(experts.pop(f"{module}.{c.name}"))
            assert np.array_equal(blob[:, c.offset : c.offset + c.nbytes], want), (layer, c.name)
            checked += 1
    assert not experts, f"tensors not packed: {sorted(experts)}"
    # the dense weights are carried over byte for byte
    dense_dst = mx.load(str(dst / "model.safetensors"))
    for k, v in dense_dst.items():
        assert mx.array_equal(v, weights[k]).item(), k
    assert set(dense_dst) == {k for k in weights if not _stacked(k, weights)}
    assert checked >= 2 * 3


def test_layout_round_trips(tiny_checkpoints, tmp_path):
    for _, dst in tiny_checkpoints.values():
        layout = packed_layout(dst)
        layout.save(tmp_path / "layout.json")
        again = ModelLayout.load(tmp_path / "layout.json")
        assert again == layout
        assert ModelLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
        config = json.loads((dst / "config.json").read_text())
        assert config["moeflux"]["total_expert_bytes"] == layout.total_expert_bytes
        assert config["moeflux"]["moe_layers"] == sorted(layout.layers)


@pytest.mark.parametrize("arch", synth.ARCHITECTURES)
def test_source_still_loads_with_mlx_lm_and_is_untouched(tiny_checkpoints, arch, tmp_path):
    src, _ = tiny_checkpoints[arch]
    before = _tree_hash(src)
    convert(src, tmp_path / "again", verify=True, progress=False)
    assert _tree_hash(src) == before
    model, tokenizer = mlx_lm.load(str(src))
    assert mlx_lm.generate(model, tokenizer, "hello", max_tokens=3)


def test_quantization_variants_convert(tmp_path):
    for bits, group in ((8, 32), (2, 128), (3, 64)):
        src = synth.build_checkpoint(
            tmp_path / f"q{bits}", "qwen3_moe", "tiny", bits=bits, group_size=group
        )
        dst = convert(src, tmp_path / f"q{bits}-packed", verify=True, progress=False)
        q = next(iter(packed_layout(dst).layers.values())).quantization
        assert (q.bits, q.group_size) == (bits, group)


def test_unquantized_experts_convert(tmp_path):
    src = synth.build_checkpoint(tmp_path / "bf16", "mixtral", "tiny", quantize=False)
    dst = convert(src, tmp_path / "bf16-packed", verify=True, progress=False)
    lay = next(iter(packed_layout(dst).layers.values()))
    assert lay.quantization is None and lay.names == (
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    )


def test_verify_names_the_corrupt_expert(tiny_checkpoints, tmp_path):
    src, _ = tiny_checkpoints["qwen3_moe"]
    dst = convert(src, tmp_path / "c", progress=False)
    layout = packed_layout(dst)
    layer, lay = sorted(layout.layers.items())[-1]
    f = packed_file(dst, layer)
    data = bytearray(f.read_bytes())
    data[5 * lay.blob_size + lay.component("down_proj.scales").offset] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(
        ConvertError, match=rf"layer_{layer:02d}.bin: expert 5 \(down_proj.scales\)"
    ):
        verify_conversion(src, dst, progress=False)


def test_refuses_existing_destination_and_non_moe(tiny_checkpoints, tmp_path):
    src, dst = tiny_checkpoints["qwen3_moe"]
    before = _tree_hash(dst)
    said = []
    assert convert(src, dst, progress=False, notify=said.append) == dst  # finished: nothing to do
    assert said and said[0].startswith("Nothing to do") and _tree_hash(dst) == before
    other, _ = tiny_checkpoints["mixtral"]
    with pytest.raises(ConvertError, match="already exists"):  # not a conversion of this source
        convert(other, dst, progress=False)
    assert _tree_hash(dst) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert(src, empty, progress=False) == empty and (empty / "config.json").is_file()
    dense = tmp_path / "dense"
    cfg = synth.model_config("qwen3_moe", "tiny")
    from mlx_lm.utils import _get_classes, save_config, save_model

    cfg = dict(cfg, model_type="qwen3")
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        cfg.pop(k, None)
    model_class, args_class = _get_classes(cfg)
    save_model(dense, model_class(args_class.from_dict(cfg)))
    save_config(cfg, dense / "config.json")
    with pytest.raises(CheckpointError, match="not an MoE checkpoint"):
        convert(dense, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_interrupted_conversion_resumes(tiny_checkpoints, tmp_path, monkeypatch):
    """A failure midway leaves no DST; the rerun resumes from the completed files and verifies."""
    cv = importlib.import_module(
        "moeflux_mlx.format.convert"
    )  # the package's `convert` is the function

    src, _ = tiny_checkpoints["deepseek_v3"]
    real, calls = cv._write_layer, []

    def failing(ckpt, layer, *a):
        calls.append(layer)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(ckpt, layer, *a)

    monkeypatch.setattr(cv, "_write_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    done = list((tmp_path / "out.partial" / "packed_experts").glob("layer_*.bin"))
    assert len(done) == 1
    monkeypatch.setattr(cv, "_write_layer", real)
    said = []
    convert(src, tmp_path / "out", verify=True, progress=False, notify=said.append)
    assert not (tmp_path / "out.partial").exists()
    assert len(said) == 1 and said[0].startswith(
        f"Resuming the interrupted conversion in {tmp_path / 'out.partial'} ("
    )


# VmHWM is this address space's peak RSS (ru_maxrss would carry the forked parent's across exec)
PEAK_SCRIPT = textwrap.dedent("""
    import sys, psutil
    from moeflux_mlx.format.convert import convert
    def hwm():
        line = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
        return int(line.split()[1]) * 1024
    base = hwm()
    convert(sys.argv[1], sys.argv[2], progress=False)
    print(base, hwm())
""")


def test_convert_peak_memory_is_bounded(tmp_path):
    src = synth.build_checkpoint(tmp_path / "medium", "qwen3_moe", "medium")
    experts = scan_checkpoint(src).layout.total_expert_bytes
    assert experts > 300e6, "the test needs experts totalling a few hundred MB"
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
    )
    base, peak = map(int, out.stdout.split())
    above = peak - base
    print(f"experts {experts / 1e6:.0f} MB, peak RSS above the interpreter {above / 1e6:.0f} MB")
    assert above < 256e6 and above < experts / 2


def test_convert_closes_every_file_it_opens(tiny_checkpoints, tmp_path):
    """Each layer's stacked tensors share a file: one descriptor per file, all closed after."""
    import gc
    import os

    src, _ = tiny_checkpoints["qwen3_moe"]
    gc.collect()
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    if before is None:
        pytest.skip("counts open descriptors through /proc")
    convert(src, tmp_path / "out", verify=True, progress=False)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
