"""Every quantization mlx-lm writes streams bit-identically to stock mlx-lm on the CPU (the
plain-ops path): affine 1-8 bits in groups of 32, 64 and 128; mxfp4, nvfp4, mxfp8; mlx-lm's mixed
recipes (per layer and per projection); unquantized experts (in every float type, and beside a
quantized rest); expert biases (gpt_oss, mxfp4 as gpt-oss ships) and SwitchMLP experts.

The expert layout's quantization, read from the headers, is what mlx-lm's loader gives each
projection (its config entry where it has one, else what the shapes say), and the converted
layout (``layout.json``) carries it unchanged. nvfp4 with its per-expert global scale is found,
converted and verified byte for byte; computing it needs the GPU (in MLX as here)."""

from __future__ import annotations

import shutil

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

import moeflux_mlx
from moeflux_mlx.format.checkpoint import packed_layout, scan_checkpoint
from moeflux_mlx.format.convert import convert
from moeflux_mlx.format.layout import Quantization
from tests.support import synth

PROMPT = [(11 * i + 5) % 500 + 3 for i in range(40)]  # 40 tokens x top-4: the sorted path
N_TOKENS = 3
AFFINE = [(b, g) for b in synth.QUANT_BITS for g in synth.GROUP_SIZES]
FLOAT_MODES = [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]


def _decode(model):
    out = []
    for (tok, lp), _ in zip(
        generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS), range(N_TOKENS)
    ):
        out.append((int(tok), lp))
    return [t for t, _ in out], mx.stack([lp for _, lp in out])


def _stock_quantization(model):
    """What stock mlx-lm loaded: expert projection path -> Quantization (None: unquantized)."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, QuantizedSwitchLinear):
            out[path] = Quantization(m.bits, m.group_size, m.mode)
        elif isinstance(m, SwitchLinear):
            out[path] = None
    return out


def _check(tmp_path, name, arch="qwen3_moe", **build):
    """Stock mlx-lm and moeflux (plain checkpoint and its verified conversion) agree bit for bit;
    the scanned layout is what stock mlx-lm loaded, projection by projection. Where stock
    mlx-lm cannot compute on this backend, moeflux fails the same way."""
    src = synth.build_checkpoint(tmp_path / name, arch, "tiny", seed=2, **build)
    stock, _ = mlx_lm.load(str(src))
    try:
        tokens, logprobs = _decode(stock)
    except RuntimeError as e:  # e.g. [GatherMM::eval] Currently only supports float32 (CPU)
        model, _ = moeflux_mlx.load(src, cache_budget=0, backend="ops")
        with model.moeflux, pytest.raises(RuntimeError) as ours:
            _decode(model)
        assert str(ours.value) == str(e)
        tokens = None
    if tokens is not None:
        assert not mx.isnan(logprobs).any().item()
    layout = scan_checkpoint(src).layout
    stock_q = _stock_quantization(stock)
    for layer, lay in layout.layers.items():
        for proj in lay.projections:
            assert lay.quant(proj) == stock_q[f"{layout.module_paths[layer]}.{proj}"], (layer, proj)
    del stock
    packed = convert(src, tmp_path / f"{name}-packed", verify=True, progress=False)
    assert packed_layout(packed).to_dict() == layout.to_dict()
    for path, io in ((src, "pread"), (packed, "mmap")) if tokens is not None else ():
        model, _ = moeflux_mlx.load(path, expert_io=io, cache_budget=0, backend="ops")
        with model.moeflux:
            got_tokens, got_logprobs = _decode(model)
        assert got_tokens == tokens, (name, io)
        assert mx.array_equal(got_logprobs, logprobs).item(), (name, io)
    shutil.rmtree(src)
    shutil.rmtree(packed)
    return layout


@pytest.mark.parametrize("bits,group_size", AFFINE, ids=[f"{b}bit-g{g}" for b, g in AFFINE])
def test_affine(tmp_path, bits, group_size):
    layout = _check(tmp_path, "q", bits=bits, group_size=group_size)
    assert {lay.quantization for lay in layout.layers.values()} == {
        Quantization(bits, group_size, "affine")
    }


@pytest.mark.parametrize("mode,bits,group_size", FLOAT_MODES, ids=[m for m, _, _ in FLOAT_MODES])
def test_float_modes(tmp_path, mode, bits, group_size):
    layout = _check(tmp_path, mode, mode=mode, bits=bits, group_size=group_size)
    for lay in layout.layers.values():
        assert lay.quantization == Quantization(bits, group_size, mode)
        assert lay.component("gate_proj.scales").dtype == "U8"
        assert "gate_proj.biases" not in lay.names


@pytest.mark.parametrize("recipe", synth.RECIPES)
def test_mixed_recipes(tmp_path, recipe):
    """mlx_lm.convert --quant-predicate mixed_*: down_proj of some layers at more bits."""
    low, high = {
        "mixed_2_6": (2, 6),
        "mixed_3_4": (3, 4),
        "mixed_3_6": (3, 6),
        "mixed_4_6": (4, 6),
    }[recipe]
    layout = _check(tmp_path, recipe, recipe=recipe, bits=low, group_size=64)
    downs = {lay.quant("down_proj").bits for lay in layout.layers.values()}
    assert downs == {low, high}  # per layer
    assert any(lay.overrides for lay in layout.layers.values())  # per projection
    assert {lay.quantization.bits for lay in layout.layers.values()} == {low}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_unquantized_experts(tmp_path, dtype):
    """Computed bit-identically in float32; bf16 / fp16 experts fail on MLX's CPU backend in
    stock mlx-lm and here alike (``gather_mm`` is float32-only there), and still convert."""
    layout = _check(tmp_path, f"fp-{dtype}", quantize=False, dtype=dtype)
    want = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[dtype]
    for lay in layout.layers.values():
        assert lay.quantization is None and not lay.overrides
        assert lay.component("gate_proj.weight").dtype == want


def test_unquantized_experts_beside_a_quantized_rest(tmp_path):
    layout = _check(
        tmp_path,
        "dense-q",
        dtype="float32",
        quant_predicate=lambda path, m: ".switch_mlp." not in path,
    )
    assert all(lay.quantization is None for lay in layout.layers.values())


def test_one_projection_unquantized(tmp_path):
    """A recipe that leaves one projection of the experts unquantized (per-projection None)."""
    layout = _check(
        tmp_path,
        "down-fp32",
        dtype="float32",
        quant_predicate=lambda path, m: not path.endswith("switch_mlp.down_proj"),
    )
    for lay in layout.layers.values():
        assert lay.quantization == Quantization(4, 64, "affine")
        assert lay.overrides == {"down_proj": None}


def test_expert_biases_in_mxfp4(tmp_path):
    """gpt_oss: experts with bias vectors and a clamped SwiGLU, mxfp4 as gpt-oss ships."""
    layout = _check(tmp_path, "gpt_oss", "gpt_oss", mode="mxfp4", bits=4, group_size=32)
    for lay in layout.layers.values():
        assert {"gate_proj.bias", "up_proj.bias", "down_proj.bias"} <= set(lay.names)
        assert lay.quantization == Quantization(4, 32, "mxfp4")


def test_switch_mlp_in_3_bits(tmp_path):
    """nemotron_h: SwitchMLP experts (fc1 / fc2, relu2), affine 3-bit."""
    layout = _check(tmp_path, "nemotron_h", "nemotron_h", bits=3, group_size=32)
    assert all(lay.projections == ("fc1", "fc2") for lay in layout.layers.values())


def test_nvfp4_global_scale_layout_and_conversion(tmp_path):
    """nvfp4 with one tensor scale per expert: found, converted, verified; computing with it
    is GPU-only in MLX, and stock mlx-lm and moeflux say so alike on the CPU."""
    src = synth.build_checkpoint(
        tmp_path / "gs", "qwen3_moe", "tiny", mode="nvfp4", bits=4, group_size=16, global_scale=True
    )
    layout = scan_checkpoint(src).layout
    for lay in layout.layers.values():
        for proj in lay.projections:
            c = lay.component(f"{proj}.global_scale")
            assert c.dtype == "F32" and c.shape == () and c.nbytes == 4
        assert lay.quantization == Quantization(4, 16, "nvfp4")
    packed = convert(src, tmp_path / "gs-packed", verify=True, progress=False)
    assert packed_layout(packed).to_dict() == layout.to_dict()
    stock, _ = mlx_lm.load(str(src))
    errors = []
    model, _ = moeflux_mlx.load(packed, cache_budget=0, backend="ops")
    with model.moeflux:
        for m in (stock, model):
            with pytest.raises(Exception) as e:
                mx.eval(m(mx.array([PROMPT[:4]])))
            errors.append(str(e.value))
    if mx.default_device() == mx.cpu:
        assert all("Global scale is only supported on the GPU" in msg for msg in errors), errors


def test_the_shapes_decide_where_the_config_names_no_module(tmp_path):
    """mlx-lm's loader reads a module's quantization off its shapes (and the scales' dtype)
    unless config.json has an entry for that very module; the top-level values are only a
    default. A config whose top level says 8-bit over 4-bit experts loads in stock mlx-lm, and
    streams the same."""
    import json

    src = synth.build_checkpoint(tmp_path / "q", "qwen3_moe", "tiny", seed=2)
    config = json.loads((src / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config[key].update(bits=8, group_size=128)
    (src / "config.json").write_text(json.dumps(config))
    stock, _ = mlx_lm.load(str(src))
    tokens, logprobs = _decode(stock)
    layout = scan_checkpoint(src).layout
    assert {lay.quantization for lay in layout.layers.values()} == {Quantization(4, 64, "affine")}
    model, _ = moeflux_mlx.load(src, cache_budget=0, backend="ops")
    with model.moeflux:
        got = _decode(model)
    assert got[0] == tokens and mx.array_equal(got[1], logprobs).item()
