"""``moeflux-mlx info`` says which backend each MoE layer's decode calls run on and why, grouped
by runs of layers, in text and in ``--json``; and it says what the runtime does: the same
decision (``compute.backend.layer_choice`` over ``compute.kernels.expert_route``), checked
against the backend each layer of a loaded model actually served (kernels stood in for by the
CPU fakes of ``test_selfcheck``)."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import moeflux_mlx
from moeflux_mlx import cli
from moeflux_mlx.commands import info
from moeflux_mlx.compute import kernels as K
from moeflux_mlx.compute import selfcheck as S
from moeflux_mlx.compute.backend import LayerChoice
from moeflux_mlx.format.convert import convert
from tests.support import synth

# the self-check's fixtures: verdicts in a temporary folder (autouse), fake kernels on the CPU
from tests.test_selfcheck import _isolated, fake_gpu, needs_cpu  # noqa: F401

# layer -> how its experts are quantized (the rest of the model: affine 4-bit, group 64)
EXPERT_QUANT = {2: dict(bits=4, group_size=32, mode="mxfp4"), 3: dict(bits=8, group_size=64)}
LAYERS = 5
GPU = r"(cuda|metal)"  # the kernels' dialect on a GPU of the platform the tests run on


def _mixed(path, m):
    """Experts of layers 2 and 3 quantized otherwise, everything else the default."""
    found = re.search(r"layers\.(\d+)\.mlp\.switch_mlp\.", path)
    return EXPERT_QUANT.get(int(found[1]), True) if found else True


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A qwen3_moe of 5 MoE layers: affine 4-bit g64, except layer 2 (mxfp4), layer 3 (8-bit)."""
    return synth.build_checkpoint(
        tmp_path_factory.mktemp("info") / "mixed",
        "qwen3_moe",
        "tiny",
        overrides={"num_hidden_layers": LAYERS},
        quant_predicate=_mixed,
    )


def _by_layer(out: str) -> list:
    """The lines of the ``backend by layer`` row: its first, and the indented ones under it."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backend by layer"))
    first = lines[start][len("backend by layer") :].strip()
    rest = [line.strip() for line in lines[start + 1 :] if line.startswith(" ")]
    return [first, *rest]


@needs_cpu
def test_cpu_groups_layers_and_says_why(mixed, capsys):
    assert cli.main(["info", str(mixed)]) == 0
    lines = _by_layer(capsys.readouterr().out)
    no_gpu = re.escape("ops (no GPU: MLX's default device is the CPU; ")
    expected = [
        rf"layers 0-1: {no_gpu}on a GPU: {GPU} kernels, affine 4-bit, group 64\)",
        rf"layer 2: {no_gpu}on a GPU: ops too, mxfp4: no fused kernel \(.*\)\)",
        rf"layer 3: {no_gpu}on a GPU: {GPU} kernels, affine 8-bit, group 64\)",
        rf"layer 4: {no_gpu}on a GPU: {GPU} kernels, affine 4-bit, group 64\)",
    ]
    assert len(lines) == len(expected), lines
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)

    # --json: the same groups, as data
    assert cli.main(["info", str(mixed), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    groups = doc["backend by layer"]
    assert [g["text"] for g in groups] == lines
    assert [g["layers"] for g in groups] == [[0, 1], [2], [3], [4]]
    assert {g["backend"] for g in groups} == {"ops"}
    assert {g["reason"] for g in groups} == {"no GPU: MLX's default device is the CPU"}
    assert doc["backend"].startswith("ops (auto, device cpu)")


@needs_cpu
def test_requested_backends_are_said(mixed, capsys):
    assert cli.main(["info", str(mixed), "--backend", "ops"]) == 0
    lines = _by_layer(capsys.readouterr().out)
    assert lines[0].startswith("layers 0-1: ops (requested (backend ops); on a GPU: ")
    assert cli.main(["info", str(mixed), "--backend", "metal", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["backend by layer"]
    assert groups[0]["reason"] == "metal kernels not available: MLX's default device is the CPU"
    assert groups[0]["on_gpu"] == "on a GPU: metal kernels, affine 4-bit, group 64"


@needs_cpu
@pytest.mark.usefixtures("fake_gpu")
def test_info_says_what_the_runtime_did(mixed, capsys):
    """With kernels (fakes) available: the mxfp4 layer goes to ops for its quantization, the
    8-bit layer for a failed self-check once the runtime recorded one, the rest to the kernels;
    and each layer's decode calls were served by exactly what info says."""
    K.break_variants("wrong", match=lambda kind, dialect, template: template["BITS"] == 8)
    assert cli.main(["info", str(mixed), "--backend", "cuda"]) == 0
    before = _by_layer(capsys.readouterr().out)
    assert before[0] == "layers 0-1: cuda kernels (affine 4-bit, group 64; self-check at first use)"
    assert before[2].startswith("layer 3: cuda kernels (affine 8-bit, group 64; self-check at")

    model, _ = moeflux_mlx.load(mixed, backend="cuda", cache_budget="all")
    prompt = mx.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])  # 11 tokens: prefill on ops
    for _, _ in zip(generate_step(prompt, model, max_tokens=3), range(3)):
        pass
    served = {i: layer["backend"] for i, layer in model.moeflux.stats_dict()["layers"].items()}
    model.moeflux.close()

    S.forget()  # a new process: the verdicts come from the disk
    assert cli.main(["info", str(mixed), "--backend", "cuda", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["backend by layer"]
    assert [g["layers"] for g in groups] == [[0, 1], [2], [3], [4]]
    assert groups[0]["text"] == (
        "layers 0-1: cuda kernels (affine 4-bit, group 64; self-check passed)"
    )
    assert groups[1]["reason"].startswith("mxfp4: no fused kernel")
    assert groups[2]["reason"].startswith("self-check failed for cuda glu+down bfloat16 8-bit g64 ")
    for g in groups:
        label = g["backend"] if g["backend"] != "ops" else f"ops (fallback: {g['reason']})"
        for layer in g["layers"]:
            decode = {k: n for k, n in served[layer].items() if not k.startswith("ops (prefill")}
            assert set(decode) == {label}, (layer, served[layer], label)


def test_converted_model_says_the_same(mixed, tmp_path, capsys):
    packed = convert(mixed, tmp_path / "packed", progress=False)
    assert cli.main(["info", str(mixed), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["backend by layer"]
    assert cli.main(["info", str(packed), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend by layer"] == plain


def test_gpt_oss_reasons(tmp_path, capsys):
    """gpt-oss as it ships (mxfp4 experts with biases, a clamped SwiGLU): the quantization is
    the reason given; quantized affine instead, the activation is."""
    src = synth.build_checkpoint(
        tmp_path / "g", "gpt_oss", "tiny", mode="mxfp4", bits=4, group_size=32
    )
    assert cli.main(["info", str(src), "--backend", "cuda", "--json"]) == 0
    (group,) = json.loads(capsys.readouterr().out)["backend by layer"]
    on_gpu = group["on_gpu"] or group["reason"]
    assert "mxfp4: no fused kernel" in on_gpu
    affine = synth.build_checkpoint(tmp_path / "a", "gpt_oss", "tiny")
    assert cli.main(["info", str(affine), "--backend", "cuda", "--json"]) == 0
    (group,) = json.loads(capsys.readouterr().out)["backend by layer"]
    assert "activation SwigluOAI is not plain SwiGLU" in (group["on_gpu"] or group["reason"])


def test_info_says_what_the_machine_decided(mixed, capsys):
    """The choices that are no load options, under their heading and in --json; off CUDA (this
    CPU machine, a Mac) decode syncs with the host and slots are written from the host."""
    assert cli.main(["info", str(mixed)]) == 0
    rows = re.findall(r"^(\S.*?|  \S.*?)\s{2,}(.*)$", capsys.readouterr().out, re.M)
    start = [k for k, _ in rows].index("decided by the machine")
    assert rows[start][1] == "not load options: chosen at load for this machine"
    under = {}
    for k, v in rows[start + 1 :]:
        if not k.startswith("  "):
            break
        under[k.strip()] = v
    assert cli.main(["info", str(mixed), "--json"]) == 0
    decided = json.loads(capsys.readouterr().out)["decided by the machine"]
    assert under == decided  # the text and --json say the same
    names = ["read threads", "device-side table", "slot writes", "whole-layer prefill"]
    assert list(decided)[:4] == names
    assert re.fullmatch(r"\d+ \(the cores, 8 to 16\).*", decided["read threads"])
    if not mx.cuda.is_available():
        assert list(decided) == names  # no miss server without the device-side table
        assert decided["device-side table"].startswith("off: one host sync per call")
        assert decided["slot writes"] == "host: straight into the slots' memory"


def test_layer_groups_label_gaps():
    choice = LayerChoice("ops", "why")
    groups = info.group_layers({1: choice, 3: choice, 5: choice, 6: LayerChoice("cuda", "q")})
    assert [g.label for g in groups] == ["layers 1-5 (3 MoE layers)", "layer 6"]
    assert str(groups[1]) == "layer 6: cuda kernels (q)"
