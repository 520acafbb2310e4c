"""The fused kernels check themselves before they serve a layer (moeflux_mlx.compute.selfcheck).

On the CPU no custom kernel can run, so the kernels are stood in for by fakes that compute what
the plain-ops path computes (``_fake_kernel``), and failures are injected with the test-only
switch ``kernels.break_variants`` (a variant that does not compile, computes wrong numbers, or
raises). On a GPU the same switch breaks the real kernels (``test_broken_variant_on_gpu``).
Whatever fails falls back to plain ops, with one warning, and its output is the ops path's.
"""

from __future__ import annotations

import json
import logging
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import SwiGLU

import moeflux_mlx
from moeflux_mlx.cache.pool import ExpertPool
from moeflux_mlx.compute import backend as B
from moeflux_mlx.compute import kernels as K
from moeflux_mlx.compute import selfcheck as S
from moeflux_mlx.compute.ops import OpsBackend
from moeflux_mlx.format.layout import Quantization
from tests.support import synth


def _gpu_dialect():
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else None


DIALECT = _gpu_dialect()
needs_gpu = pytest.mark.skipif(
    DIALECT is None,
    reason="needs MLX with a Metal or CUDA GPU (custom kernels cannot run on the CPU)",
)
needs_cpu = pytest.mark.skipif(
    DIALECT is not None, reason="the fakes stand in for kernels only on the CPU"
)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Verdicts in a temporary folder, a fresh process's memory, no broken variant left over."""
    monkeypatch.setattr(S, "CACHE_DIR", tmp_path / "selfcheck")
    S.forget()
    K.break_variants(None)
    yield
    K.break_variants(None)
    S.forget()


def _fake_kernel(kind, dialect, variant="plain", broken=None):
    """A stand-in for one compiled kernel on the CPU: the plain-ops computation of glu / down,
    through the same ``gather_qmm`` calls OpsBackend makes (so a correct fake is exact)."""

    def run(inputs, template, output_shapes, output_dtypes, init_value=None, **kw):
        if broken == "compile":
            raise RuntimeError(
                f"[metal::Device] Unable to build metal library from source\nerror: {kind}"
            )
        t = dict(template)
        q = dict(group_size=t["GSZ"], bits=t["BITS"], transpose=True)
        act, slots = inputs[0], inputs[1]
        if kind == "glu":
            wg, sg, bg, wu, su, bu = inputs[2:8]  # CUDA's in_place comes after
            x = mx.expand_dims(act, (-2, -3))
            gate = mx.gather_qmm(x, wg, sg, bg, rhs_indices=slots, **q)
            up = mx.gather_qmm(x, wu, su, bu, rhs_indices=slots, **q)
            out = SwiGLU()(up, gate).squeeze(-2)
        else:
            wd, sd, bd = inputs[2:5]
            out = mx.gather_qmm(
                mx.expand_dims(act, -2), wd, sd, bd, rhs_indices=slots, **q
            ).squeeze(-2)
        if broken == "wrong":
            out = out * 1.5
        assert tuple(out.shape) == tuple(output_shapes[0]) and out.dtype == output_dtypes[0]
        return [out]

    return run


@pytest.fixture
def fake_gpu(monkeypatch):
    """Kernels 'available' on the CPU, computed by the fakes."""
    monkeypatch.setattr(K, "_kernel", _fake_kernel)
    monkeypatch.setattr(K, "dialect_available", lambda dialect: True)


def _pool(bits=4, gs=64, hid=256, inter=128, n=6, dtype=mx.float32, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    arrays = {}
    for key, (proj, (o, i)) in zip(
        keys,
        {"gate_proj": (inter, hid), "up_proj": (inter, hid), "down_proj": (hid, inter)}.items(),
    ):
        w = (mx.random.normal((n, o, i), key=key) / math.sqrt(i)).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        arrays[f"{proj}.weight"], arrays[f"{proj}.scales"], arrays[f"{proj}.biases"] = wq, s, b
    return ExpertPool(arrays, Quantization(bits, gs))


def _call(n_tok=1, topk=4, hid=256, n=6, seed=0, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    x = mx.random.normal((1, n_tok, hid), key=mx.random.key(seed)).astype(dtype)
    slots = mx.array(np.stack([rng.choice(n, topk, replace=False) for _ in range(n_tok)])[None])
    return x, slots.astype(mx.uint32)


@needs_cpu
def test_passing_variant_serves_and_is_remembered_on_disk(fake_gpu):
    kb = K.KernelBackend("metal", OpsBackend())
    pool = _pool()
    x, slots = _call()
    out = kb(x, slots, pool, SwiGLU())
    assert kb.last_served == "metal"
    (plan,) = pool.plans.values()
    assert plan.launches is not None and plan.served == "metal"
    assert mx.array_equal(out, OpsBackend()(x, slots, pool, SwiGLU())).item()
    check = S.checker("metal", K.source_digest("metal"))
    assert check.runs == 1
    label = kb.variant(x, slots, pool).label
    assert label == "metal glu+down float32 4-bit g64 H256 I128 K4 T1"
    doc = json.loads(check.path.read_text())
    assert doc["variants"][label]["ok"] and doc["mlx"] == mx.__version__
    assert doc["kernel_source"] == K.source_digest("metal")
    # another layer's pool of the same shape: no second check
    kb(x, slots, _pool(seed=1), SwiGLU())
    assert check.runs == 1
    # a new process: the verdict comes from disk, the check does not run again
    S.forget()
    kb2 = K.KernelBackend("metal", OpsBackend())
    kb2(x, slots, _pool(seed=2), SwiGLU())
    again = S.checker("metal", K.source_digest("metal"))
    assert again is not check and again.runs == 0 and again.verdicts[label].cached
    # another shape class (8 tokens) is another variant: checked once
    x8, s8 = _call(n_tok=8)
    kb2(x8, s8, _pool(seed=2), SwiGLU())
    assert again.runs == 1


@needs_cpu
@pytest.mark.parametrize("mode", K.BREAK_MODES)
def test_injected_failure_falls_back_with_one_warning(fake_gpu, mode, caplog):
    K.break_variants(mode, match=lambda kind, dialect, t: t["BITS"] == 8)
    kb = K.KernelBackend("metal", OpsBackend())
    ops = OpsBackend()
    x, slots = _call()
    caplog.set_level(logging.WARNING, logger="moeflux_mlx")
    for seed in range(3):  # three layers with the broken variant: one warning
        pool8 = _pool(bits=8, seed=seed)
        out = kb(x, slots, pool8, SwiGLU())
        assert mx.array_equal(out, ops(x, slots, pool8, SwiGLU())).item()  # the ops path's, exactly
        assert kb.last_served.startswith("ops (fallback: self-check failed for metal glu+down")
    label = "metal glu+down float32 8-bit g64 H256 I128 K4 T1"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert label in text
    assert {
        "compile": "Unable to build metal library",
        "wrong": "mismatch",
        "raise": "deliberately broken",
    }[mode] in text
    # the other variants keep the kernels
    pool4 = _pool(bits=4)
    kb(x, slots, pool4, SwiGLU())
    assert kb.last_served == "metal"
    # a new process with the same (broken) kernel text finds the failure on disk: no check,
    # one warning again, still the ops path
    S.forget()
    caplog.clear()
    kb2 = K.KernelBackend("metal", OpsBackend())
    pool8 = _pool(bits=8, seed=7)
    out = kb2(x, slots, pool8, SwiGLU())
    assert mx.array_equal(out, ops(x, slots, pool8, SwiGLU())).item()
    assert S.checker("metal", K.source_digest("metal")).runs == 0
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1


@needs_cpu
def test_streaming_model_output_stays_the_ops_paths(fake_gpu, tmp_path, caplog):
    """A whole model whose every kernel variant fails its check decodes exactly as the ops
    backend does, and stats say which backend ran each layer and why."""
    src = synth.build_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=3)
    K.break_variants("wrong")
    caplog.set_level(logging.WARNING, logger="moeflux_mlx")

    def decode(model, n=12):
        prompt = mx.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
        out = []
        for (tok, lp), _ in zip(generate_step(prompt, model, max_tokens=n), range(n)):
            out.append((int(tok), np.array(lp.astype(mx.float32))))
        return out

    ref_model, _ = moeflux_mlx.load(src, backend="ops", cache_budget="all")
    model, _ = moeflux_mlx.load(src, backend="metal", cache_budget="all")
    assert model.moeflux.stats_dict()["backend"] == "metal"  # before any call: what will run
    ref, got = decode(ref_model), decode(model)
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, ref))
    st = model.moeflux.stats_dict()
    assert st["backend_requested"] == "metal"
    for layer in st["layers"].values():
        labels = set(layer["backend"])
        assert "ops (prefill: more than 8 tokens)" in labels  # the 11-token prompt
        assert any(
            lbl.startswith("ops (fallback: self-check failed for metal glu+down") for lbl in labels
        )
    assert "% of calls" in st["backend"] and "self-check failed" in st["backend"]
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1  # one variant: T = 1
    model.moeflux.close()
    ref_model.moeflux.close()


def test_backend_that_cannot_run_is_accepted_and_reported(caplog):
    caplog.set_level(logging.WARNING, logger="moeflux_mlx")
    B._WARNED.discard("metal")
    kb = B.select_backend("metal")
    B.select_backend("metal")
    if DIALECT == "metal":
        assert B.backend_report(kb) == "metal"
        return
    assert kb.name == "metal"
    report = B.backend_report(kb)
    assert report.startswith("ops (fallback: metal ") and "not available" in report
    assert sum("backend 'metal' requested" in r.getMessage() for r in caplog.records) == 1
    pool = _pool()
    x, slots = _call()
    with mx.stream(mx.cpu):
        assert mx.array_equal(
            kb(x, slots, pool, SwiGLU()), OpsBackend()(x, slots, pool, SwiGLU())
        ).item()
    assert kb.last_served == report
    assert B.backend_report(OpsBackend()) == "ops"
    assert B.served_summary({}, "x") == "x"
    assert B.served_summary({"metal": 3}, "x") == "metal"
    assert B.served_summary({"metal": 3, "ops (prefill)": 1}, "x") == (
        "metal: 75% of calls; ops (prefill): 25% of calls"
    )


def test_verdict_cache_file_names_machine_mlx_and_source(monkeypatch, tmp_path):
    monkeypatch.setattr(S, "CACHE_DIR", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = S.cache_file("metal", K.source_digest("metal"))
    assert path.parent == tmp_path / "xdg" / "moeflux-mlx" / "selfcheck"
    assert (
        path.name == f"metal-{S.machine_id()}-mlx{mx.__version__}-{K.source_digest('metal')}.json"
    )
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(S.cache_root()).endswith(".cache/moeflux-mlx/selfcheck")
    # the hash follows the kernel text
    assert K.source_digest("metal") != K.source_digest("cuda")


def test_relative_error_catches_what_is_wrong():
    ref = mx.array(np.ones((2, 4), np.float32))
    assert S.relative_error(ref, ref, "float32") == 0.0
    for bad, why in (
        (mx.array(np.full((2, 4), np.nan, np.float32)), "not written or not finite"),
        (ref * 1.01, "> 1e-05"),
        (ref.reshape(4, 2), "expected"),
        (ref.astype(mx.float16), "expected"),
    ):
        with pytest.raises(S.SelfCheckMismatch, match=why):
            S.relative_error(bad, ref, "float32")


def test_check_pool_is_laid_out_like_blobs():
    pool = _pool(bits=8, gs=32, dtype=mx.bfloat16)
    v = S.Variant("metal", "bfloat16", "bfloat16", "uint32", 8, 32, 256, 128, 4, 1)
    test = S.random_pool_like(pool, v)
    for name, arr in pool.arrays.items():
        t = test.arrays[name]
        assert t.shape == (S.CHECK_SLOTS, *arr.shape[1:]) and t.dtype == arr.dtype
    x, slots = S.random_inputs(v, (1, 1, 256), (1, 1, 4), S.CHECK_SLOTS)
    assert x.dtype == mx.bfloat16 and slots.dtype == mx.uint32
    assert int(slots.max().item()) < S.CHECK_SLOTS
    y = OpsBackend()(x, slots, test, SwiGLU()).astype(mx.float32)
    assert bool(mx.isfinite(y).all().item()) and 1e-3 < float(mx.abs(y).mean().item()) < 1e3
    # the same variant gets the same inputs (a failure is reproducible)
    assert mx.array_equal(
        S.random_pool_like(pool, v).arrays["up_proj.scales"], test.arrays["up_proj.scales"]
    )


@pytest.mark.parametrize("dialect", ["metal", "cuda"])
def test_wrong_mode_breaks_the_shared_dot_products(dialect):
    """'wrong' must reach the dot products the header defines (a redefinition after them would
    leave the GLU and down kernels right), and broken kernels keep their verdicts apart."""
    header, body = K.kernel_text("glu", dialect)
    broken, _ = K._break_text("wrong", header, body)
    defs = [ln for ln in broken.splitlines() if ln.startswith("#define MF_FMA")]
    assert defs == ["#define MF_FMA(a, b, c) ((a) * (b) - (c))"]
    assert broken.index("#define MF_FMA") < broken.index("MfChunk")
    real = K.source_digest(dialect)
    K.break_variants("wrong")
    assert K.source_digest(dialect) != real
    K.break_variants(None)
    assert K.source_digest(dialect) == real


def test_break_switch_is_validated():
    with pytest.raises(ValueError):
        K.break_variants("slow")
    K.break_variants("wrong", match=lambda kind, d, t: kind == "down")
    assert (
        K._broken_mode("down", "metal", {}) == "wrong"
        and K._broken_mode("glu", "metal", {}) is None
    )
    K.break_variants(None)
    assert K._broken_mode("down", "metal", {}) is None


# ---------------------------------------------------------------------------------------------
# GPU: the real kernels, one variant deliberately broken


@needs_gpu
@pytest.mark.parametrize("mode", K.BREAK_MODES)
def test_broken_variant_on_gpu(mode, caplog):
    """On the GPU: the 8-bit variant is broken for real (a kernel text that does not compile,
    one that computes wrong numbers, a launch that raises); it falls back to ops with one
    warning and its output is the ops path's bit for bit; the 4-bit variant passes its check and
    runs the kernels, close to ops."""
    caplog.set_level(logging.WARNING, logger="moeflux_mlx")
    K.break_variants(mode, match=lambda kind, dialect, t: t["BITS"] == 8)
    kb = K.KernelBackend(DIALECT, OpsBackend())
    ops = OpsBackend()
    hid, inter, topk = 2048, 768, 8  # Qwen3-30B-A3B
    x, slots = _call(n_tok=1, topk=topk, hid=hid, n=12, dtype=mx.bfloat16)
    pool8 = _pool(bits=8, gs=64, hid=hid, inter=inter, n=12, dtype=mx.bfloat16)
    out8 = kb(x, slots, pool8, SwiGLU())
    assert mx.array_equal(out8, ops(x, slots, pool8, SwiGLU())).item()
    assert kb.last_served.startswith("ops (fallback: self-check failed")
    pool4 = _pool(bits=4, gs=64, hid=hid, inter=inter, n=12, dtype=mx.bfloat16)
    out4 = kb(x, slots, pool4, SwiGLU())
    assert kb.last_served == DIALECT
    ref = ops(x, slots, pool4, SwiGLU()).astype(mx.float32)
    err = float(mx.linalg.norm(out4.astype(mx.float32) - ref).item() / mx.linalg.norm(ref).item())
    assert err < S.TOLERANCE["bfloat16"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1
        and f"{DIALECT} glu+down bfloat16 8-bit g64 H2048 I768 K8 T1" in warnings[0]
    )
    check = S.checker(DIALECT, K.source_digest(DIALECT))
    assert (
        check.runs == 2
        and not check.verdicts[f"{DIALECT} glu+down bfloat16 8-bit g64 H2048 I768 K8 T1"].ok
    )


@needs_gpu
def test_every_default_variant_passes_on_gpu():
    """The unbroken kernels pass their self-check at Qwen3-30B-A3B's shape for 4 and 8 bits and
    the three dtypes, one token per call (each variant compiles once: NVRTC on CUDA is slow)."""
    kb = K.KernelBackend(DIALECT, OpsBackend())
    hid, inter, topk = 2048, 768, 8
    for bits in (4, 8):
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            pool = _pool(bits=bits, gs=64, hid=hid, inter=inter, n=topk + 2, dtype=dtype)
            x, slots = _call(n_tok=1, topk=topk, hid=hid, n=topk + 2, dtype=dtype)
            kb(x, slots, pool, SwiGLU())
            assert kb.last_served == DIALECT, kb.last_served
    check = S.checker(DIALECT, K.source_digest(DIALECT))
    assert check.runs == 6 and all(v.ok and v.rel_err is not None for v in check.verdicts.values())
