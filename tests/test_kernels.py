"""Fused expert kernels (moeflux_mlx.compute.kernels).

GPU tests compare every kernel with a float64 numpy dequantize-and-multiply reference on fresh
random inputs, with outputs poisoned (NaN) before each run and checked fully written. They run where
MLX has a Metal or CUDA backend and skip elsewhere. CPU tests check source loading, the assembly of
the shared kernel text for both dialects, and KernelBackend's routing/fallback.

Error measure: ||out - ref|| / ||ref|| over the whole output (float64), against
  * the plain float64 reference (TOL, per activation dtype), and, for the GLU kernel,
  * the float64 reference with the kernel's documented roundings applied (gate, up and each step
    of silu(gate) * up rounded to the activation dtype, as mlx-lm's SwitchGLU does) (TOL_ROUNDED).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwiGLU

from moeflux_mlx.cache.pool import IN_PLACE_BIT, ExpertPool, InPlaceExperts
from moeflux_mlx.compute import kernel_source
from moeflux_mlx.compute import kernels as K
from moeflux_mlx.compute.ops import OpsBackend
from moeflux_mlx.format.layout import ExpertLayout, Quantization


def _gpu_dialect():
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


DIALECT = _gpu_dialect()
needs_gpu = pytest.mark.skipif(
    DIALECT is None,
    reason="needs MLX with a Metal or CUDA GPU backend (custom kernels cannot run on the CPU)",
)

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
DNAME = {mx.bfloat16: "bf16", mx.float16: "fp16", mx.float32: "fp32"}
# ||out - ref|| / ||ref|| against float64. bf16 keeps 8 significant bits (one rounding: <= 2^-9
# relative), fp16 11 bits (2^-12); fp32 accumulation over a few thousand terms stays near 1e-6.
TOL = {mx.bfloat16: 1e-2, mx.float16: 2e-3, mx.float32: 1e-5}
# GLU against the reference with the same roundings applied: only 1-ulp rounding flips remain.
TOL_ROUNDED = {mx.bfloat16: 5e-3, mx.float16: 1e-3, mx.float32: 1e-5}
# KernelBackend against OpsBackend (gather_qmm): two fp32-accumulating implementations, both
# rounding gate/up/h to the activation dtype.
TOL_OPS = {mx.bfloat16: 2e-2, mx.float16: 3e-3, mx.float32: 1e-5}

# (hidden H, intermediate I, experts K) of real models
MODELS = {
    "qwen3-30b-a3b": (2048, 768, 8),
    "qwen3.5-397b-a17b": (4096, 1024, 10),
    "deepseek-v3": (7168, 2048, 8),
}

RESULTS = []  # (kernel, case, relative error) for the report


@pytest.fixture(autouse=True)
def _selfcheck_cache(tmp_path, monkeypatch):
    """KernelBackend checks each variant on first use: keep its verdicts out of ~/.cache."""
    from moeflux_mlx.compute import selfcheck

    monkeypatch.setattr(selfcheck, "CACHE_DIR", tmp_path / "selfcheck")
    selfcheck.forget()
    yield
    selfcheck.forget()


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("MOEFLUX_KERNEL_REPORT")
    if path and RESULTS:
        worst = {}
        for kind, case, err in RESULTS:
            key = f"{kind}/{case['dtype']}"
            worst[key] = max(worst.get(key, 0.0), err)
        with open(path, "w") as f:
            json.dump(
                {
                    "dialect": DIALECT,
                    "cases": len(RESULTS),
                    "max_rel_err": worst,
                    "results": [{"kernel": k, **c, "rel_err": e} for k, c, e in RESULTS],
                },
                f,
                indent=1,
            )


# ---------------------------------------------------------------------------------------------
# helpers


def _np(a: mx.array) -> np.ndarray:
    if a.dtype in (mx.bfloat16, mx.float16, mx.float32):
        return np.array(a.astype(mx.float32)).astype(np.float64)
    return np.array(a)


def _round(v: np.ndarray, dtype) -> np.ndarray:
    return _np(mx.array(v.astype(np.float32)).astype(dtype))


def _rel(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _dequant(w: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int, gs: int) -> np.ndarray:
    """float64 dequantization of one expert's [O, P] packed uint32 rows (MLX affine layout)."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    q = ((w[..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(w.shape[0], -1)
    return q.astype(np.float64) * np.repeat(s, gs, axis=-1) + np.repeat(b, gs, axis=-1)


class RefPool:
    """float64 dequantized experts, computed on demand from the pool arrays."""

    def __init__(self, arrays, bits, gs):
        self.np = {k: _np(v) for k, v in arrays.items()}
        self.bits, self.gs, self.cache = bits, gs, {}

    def w(self, proj, slot):
        key = (proj, slot)
        if key not in self.cache:
            a = self.np
            self.cache[key] = _dequant(
                a[f"{proj}.weight"][slot],
                a[f"{proj}.scales"][slot],
                a[f"{proj}.biases"][slot],
                self.bits,
                self.gs,
            )
        return self.cache[key]


def make_arrays(n, hid, inter, bits, gs, sdtype, seed=0):
    """A pool of n random experts, MLX-quantized; scales/biases in sdtype."""
    keys = mx.random.split(mx.random.key(seed), 3)
    arrays = {}
    for key, (proj, (o, i)) in zip(
        keys,
        {"gate_proj": (inter, hid), "up_proj": (inter, hid), "down_proj": (hid, inter)}.items(),
    ):
        w = (mx.random.normal((n, o, i), key=key) / math.sqrt(i)).astype(sdtype)
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        arrays[f"{proj}.weight"], arrays[f"{proj}.scales"], arrays[f"{proj}.biases"] = wq, s, b
    mx.eval(arrays)
    return arrays


def make_slots(rng, n_tok, topk, n_slots):
    return mx.array(
        np.stack([rng.choice(n_slots, topk, replace=False) for _ in range(n_tok)]).astype(np.int32)
    )


def ref_glu(ref: RefPool, x: np.ndarray, slots: np.ndarray, dtype=None) -> np.ndarray:
    g = np.stack([[ref.w("gate_proj", s) @ x[t] for s in slots[t]] for t in range(len(slots))])
    u = np.stack([[ref.w("up_proj", s) @ x[t] for s in slots[t]] for t in range(len(slots))])
    if dtype is None:
        return g / (1.0 + np.exp(-g)) * u
    r = lambda v: _round(v, dtype)  # noqa: E731
    g, u = r(g), r(u)
    return r(r(g * r(1.0 / (1.0 + np.exp(-g)))) * u)


def ref_down(ref: RefPool, h: np.ndarray, slots: np.ndarray) -> np.ndarray:
    return np.stack(
        [
            [ref.w("down_proj", s) @ h[t, k] for k, s in enumerate(slots[t])]
            for t in range(len(slots))
        ]
    )


def check_glu(arrays, ref, x, slots, bits, gs, case, config=None):
    dtype = x.dtype
    h = K.glu_matvec(
        x,
        arrays,
        slots,
        bits=bits,
        group_size=gs,
        dialect=DIALECT,
        config=config,
        init_value=float("nan"),
    )
    assert h.shape == (*slots.shape, arrays["gate_proj.weight"].shape[1]) and h.dtype == dtype
    out = _np(h)
    assert np.isfinite(out).all(), "GLU output not fully written"
    xs, ss = _np(x), np.array(slots)
    err = _rel(out, ref_glu(ref, xs, ss))
    err_r = _rel(out, ref_glu(ref, xs, ss, dtype))
    RESULTS.append(("glu", case, err))
    assert err < TOL[dtype], f"GLU {case}: rel err {err:.2e}"
    assert err_r < TOL_ROUNDED[dtype], f"GLU {case}: rel err vs rounded ref {err_r:.2e}"
    return h


def check_down(arrays, ref, h, slots, bits, gs, case, config=None):
    y = K.down_matvec(
        h,
        arrays,
        slots,
        bits=bits,
        group_size=gs,
        dialect=DIALECT,
        config=config,
        init_value=float("nan"),
    )
    assert y.shape == (*slots.shape, arrays["down_proj.weight"].shape[1]) and y.dtype == h.dtype
    out = _np(y)
    assert np.isfinite(out).all(), "down output not fully written"
    err = _rel(out, ref_down(ref, _np(h), np.array(slots)))
    RESULTS.append(("down", case, err))
    assert err < TOL[h.dtype], f"down {case}: rel err {err:.2e}"
    return y


# ---------------------------------------------------------------------------------------------
# GPU: kernels against float64


SMALL = dict(hid=512, inter=256, n=6, topk=4)


@needs_gpu
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DNAME[d])
def test_glu_down_small(dtype, bits, gs):
    hid, inter, n, topk = SMALL["hid"], SMALL["inter"], SMALL["n"], SMALL["topk"]
    seed = 17 * bits + gs + len(DNAME[dtype])
    arrays = make_arrays(n, hid, inter, bits, gs, dtype, seed)
    ref = RefPool(arrays, bits, gs)
    rng = np.random.default_rng(seed)
    for n_tok in (1, 3, 8):
        case = dict(shape="small", dtype=DNAME[dtype], bits=bits, gs=gs, T=n_tok)
        x = mx.random.normal((n_tok, hid)).astype(dtype)
        slots = make_slots(rng, n_tok, topk, n)
        check_glu(arrays, ref, x, slots, bits, gs, case)
        h = mx.random.normal((n_tok, topk, inter)).astype(dtype)
        check_down(arrays, ref, h, slots, bits, gs, case)


@needs_gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_launch_configs_and_ragged_rows(bits):
    """Every launch shape computes the same function, also when rows do not fill the last
    threadgroup (hid 384 / inter 192 are not multiples of the rows per threadgroup)."""
    hid, inter, n, topk, gs = 384, 192, 5, 3, 64
    arrays = make_arrays(n, hid, inter, bits, gs, mx.bfloat16, seed=bits)
    ref = RefPool(arrays, bits, gs)
    rng = np.random.default_rng(bits)
    nch_h, nch_i = hid * bits // 128, inter * bits // 128
    glu_cfgs = [
        dict(lpr=lanes, nw=w, rpw=r)
        for lanes in (1, 2, 4)
        if nch_h % lanes == 0
        for w, r in ((1, 1), (2, 3), (8, 2))
    ]
    down_cfgs = [
        dict(lpr=lanes, nw=w, rpw=r, nr=k)
        for lanes in (1, 2)
        if nch_i % lanes == 0
        for w, r, k in ((1, 1, 1), (2, 2, 3), (4, 1, 4))
    ]
    for n_tok in (1, 3):
        x = mx.random.normal((n_tok, hid)).astype(mx.bfloat16)
        h = mx.random.normal((n_tok, topk, inter)).astype(mx.bfloat16)
        slots = make_slots(rng, n_tok, topk, n)
        for cfg in glu_cfgs:
            check_glu(
                arrays,
                ref,
                x,
                slots,
                bits,
                gs,
                dict(shape="ragged", dtype="bf16", bits=bits, gs=gs, T=n_tok, cfg=cfg),
                cfg,
            )
        for cfg in down_cfgs:
            check_down(
                arrays,
                ref,
                h,
                slots,
                bits,
                gs,
                dict(shape="ragged", dtype="bf16", bits=bits, gs=gs, T=n_tok, cfg=cfg),
                cfg,
            )


@needs_gpu
@pytest.mark.parametrize("model", list(MODELS))
def test_model_shapes(model):
    hid, inter, topk = MODELS[model]
    bits, gs, dtype = 4, 64, mx.bfloat16
    n = topk + 2
    arrays = make_arrays(n, hid, inter, bits, gs, dtype, seed=len(model))
    ref = RefPool(arrays, bits, gs)
    rng = np.random.default_rng(len(model))
    for n_tok in (1, 3):
        case = dict(shape=model, dtype="bf16", bits=bits, gs=gs, T=n_tok)
        x = mx.random.normal((n_tok, hid)).astype(dtype)
        slots = make_slots(rng, n_tok, topk, n)
        h = check_glu(arrays, ref, x, slots, bits, gs, case)
        check_down(arrays, ref, h, slots, bits, gs, case)


@needs_gpu
def test_mixed_dtypes_8bit_model_shape():
    """fp32 activations with bf16 scales (checkpoint dtype differs from compute dtype), 8-bit."""
    hid, inter, topk = MODELS["qwen3.5-397b-a17b"]
    arrays = make_arrays(topk + 1, hid, inter, 8, 128, mx.bfloat16, seed=5)
    ref = RefPool(arrays, 8, 128)
    rng = np.random.default_rng(5)
    x = mx.random.normal((2, hid))
    slots = make_slots(rng, 2, topk, topk + 1)
    case = dict(shape="397b-8bit-mixed", dtype="fp32", bits=8, gs=128, T=2)
    h = check_glu(arrays, ref, x, slots, 8, 128, case)
    check_down(arrays, ref, h, slots, 8, 128, case)


def _strided(a: mx.array) -> mx.array:
    """The same values as a view with inner stride 2 (forces the word-by-word load path)."""
    return mx.stack([a, mx.zeros_like(a)], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])[
        ..., ::2
    ]


@needs_gpu
def test_pool_views_without_copies():
    """Pools as strided views: blobs (ExpertPool.from_blobs), misaligned views, inner stride 2.
    Same arithmetic in every path, so the results are bit-identical to a contiguous pool."""
    hid, inter, n, topk, bits, gs = 512, 256, 5, 4, 4, 64
    arrays = make_arrays(n, hid, inter, bits, gs, mx.bfloat16, seed=3)
    names = sorted(arrays)
    tensors = {
        k: ("U32" if arrays[k].dtype == mx.uint32 else "BF16", tuple(arrays[k].shape))
        for k in names
    }
    layout = ExpertLayout.from_tensors(tensors, Quantization(bits, gs))
    blobs = np.zeros((n, layout.blob_size + 64), np.uint8)
    shifted = np.zeros_like(blobs)
    for c in layout.components:
        a = arrays[c.name]
        raw = (
            np.array(a if a.dtype == mx.uint32 else a.view(mx.uint16)).view(np.uint8).reshape(n, -1)
        )
        blobs[:, c.offset : c.offset + c.nbytes] = raw
        shifted[:, c.offset + 4 : c.offset + 4 + c.nbytes] = raw
    blob_pool = ExpertPool.from_blobs(mx.array(blobs[:, : layout.blob_size]), layout).arrays
    mshift = mx.array(shifted)
    misaligned = {
        c.name: mshift[:, c.offset + 4 : c.offset + 4 + c.nbytes]
        .view(mx.uint32 if c.dtype == "U32" else mx.bfloat16)
        .reshape(n, *c.shape)
        for c in layout.components
    }
    strided = {k: _strided(v) for k, v in arrays.items()}
    rng = np.random.default_rng(3)
    x = mx.random.normal((3, hid)).astype(mx.bfloat16)
    slots = make_slots(rng, 3, topk, n)
    h0 = K.glu_matvec(x, arrays, slots, bits=bits, group_size=gs, dialect=DIALECT)
    y0 = K.down_matvec(h0, arrays, slots, bits=bits, group_size=gs, dialect=DIALECT)
    for label, pool in (("blobs", blob_pool), ("misaligned", misaligned), ("stride2", strided)):
        h = K.glu_matvec(
            x, pool, slots, bits=bits, group_size=gs, dialect=DIALECT, init_value=float("nan")
        )
        y = K.down_matvec(
            h0, pool, slots, bits=bits, group_size=gs, dialect=DIALECT, init_value=float("nan")
        )
        assert mx.array_equal(h, h0).item(), label
        assert mx.array_equal(y, y0).item(), label


@needs_gpu
def test_strided_activations_and_slots():
    """x and slots are read through their strides, as mlx-lm hands them over (the router's
    ``argpartition(...)[..., -k:]`` is a strided slice): bit-identical to contiguous copies,
    for leading dims [T] and [1, T], inner stride 2 and a transposed view."""
    hid, inter, n, topk, bits, gs = 512, 256, 9, 4, 4, 64
    arrays = make_arrays(n, hid, inter, bits, gs, mx.bfloat16, seed=5)
    q = dict(bits=bits, group_size=gs, dialect=DIALECT)
    n_tok = 3
    logits = mx.random.normal((1, n_tok, n))
    slots = mx.argpartition(logits, kth=-topk, axis=-1)[..., -topk:]
    wide = mx.random.normal((1, n_tok, 2 * hid)).astype(mx.bfloat16)
    cases = {
        "stride2": wide[..., ::2],
        "transposed": mx.random.normal((hid, n_tok)).astype(mx.bfloat16).T[None],
    }
    for label, x in cases.items():
        xc, sc = mx.contiguous(x), mx.contiguous(slots)
        h0 = K.glu_matvec(xc[0], arrays, sc[0], **q)
        y0 = K.down_matvec(h0, arrays, sc[0], **q)
        h = K.glu_matvec(x, arrays, slots, init_value=float("nan"), **q)
        y = K.down_matvec(h, arrays, slots, init_value=float("nan"), **q)
        assert h.shape == (1, n_tok, topk, inter) and y.shape == (1, n_tok, topk, hid)
        assert mx.array_equal(h[0], h0).item() and mx.array_equal(y[0], y0).item(), label
        # down reads h through its strides too
        ht = mx.swapaxes(mx.swapaxes(h, 1, 2).astype(mx.float32).astype(mx.bfloat16), 1, 2)
        assert mx.array_equal(K.down_matvec(ht, arrays, slots, **q), y).item(), label
        kb = K.KernelBackend(DIALECT, OpsBackend())
        assert mx.array_equal(
            kb(x, slots, ExpertPool(arrays, Quantization(bits, gs)), SwiGLU()), y
        ).item(), label


@needs_gpu
@pytest.mark.parametrize("variant", ["plain", "shared", "gated"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DNAME[d])
def test_combine(dtype, variant):
    rng = np.random.default_rng(len(variant))
    for hid, topk in ((4096, 10), (7168, 8), (200, 3)):
        for n_tok in (1, 3, 8):
            res = mx.random.normal((n_tok, hid)).astype(dtype)
            y = mx.random.normal((n_tok, topk, hid)).astype(dtype)
            w = mx.array(rng.dirichlet(np.ones(topk), n_tok).astype(np.float32))
            if dtype != mx.float32:
                w = w.astype(dtype)
            shared = mx.random.normal((n_tok, hid)).astype(dtype) if variant != "plain" else None
            gate = mx.random.normal((n_tok, 1)).astype(dtype) if variant == "gated" else None
            out = K.combine(res, y, w, shared, gate, dialect=DIALECT, init_value=float("nan"))
            assert out.shape == res.shape and out.dtype == dtype
            o = _np(out)
            assert np.isfinite(o).all(), "combine output not fully written"
            ref = _np(res) + np.einsum("tk,tkh->th", _np(w), _np(y))
            if shared is not None:
                s = _np(shared)
                if gate is not None:
                    s = s / (1.0 + np.exp(-_np(gate)))
                ref = ref + s
            err = _rel(o, ref)
            RESULTS.append(
                (
                    "combine",
                    dict(shape=f"{hid}x{topk}", variant=variant, dtype=DNAME[dtype], T=n_tok),
                    err,
                )
            )
            assert err < TOL[dtype], f"combine {variant} {hid}: {err:.2e}"


@needs_gpu
@pytest.mark.parametrize("n_tok", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DNAME[d])
def test_backend_matches_ops(dtype, n_tok):
    hid, inter, topk = MODELS["qwen3-30b-a3b"]
    n = 12
    pool = ExpertPool(make_arrays(n, hid, inter, 4, 64, dtype, seed=n_tok), Quantization(4, 64))
    rng = np.random.default_rng(n_tok)
    x = mx.random.normal((1, n_tok, hid)).astype(dtype)
    slots = make_slots(rng, n_tok, topk, n).reshape(1, n_tok, topk)
    kb = K.KernelBackend(DIALECT, OpsBackend())
    assert kb.route(x, slots, pool, SwiGLU()) is None
    a = kb(x, slots, pool, SwiGLU())
    b = OpsBackend()(x, slots, pool, SwiGLU())
    # the second call takes the launch plan worked out by the first, with new inputs
    (plan,) = pool.plans.values()
    assert plan.launches is not None and plan.served == DIALECT
    x2 = mx.random.normal((1, n_tok, hid)).astype(dtype)
    slots2 = make_slots(rng, n_tok, topk, n).reshape(1, n_tok, topk).astype(mx.uint32)
    a2 = kb(x2, slots2, pool, SwiGLU())
    assert _rel(_np(a2), _np(OpsBackend()(x2, slots2, pool, SwiGLU()))) < TOL_OPS[dtype]
    assert a.shape == b.shape == (1, n_tok, topk, hid) and a.dtype == b.dtype == dtype
    err = _rel(_np(a), _np(b))
    RESULTS.append(
        ("backend-vs-ops", dict(shape="qwen3-30b-a3b", dtype=DNAME[dtype], T=n_tok), err)
    )
    assert err < TOL_OPS[dtype], f"KernelBackend vs OpsBackend: {err:.2e}"


@needs_gpu
def test_backend_falls_back_on_gpu():
    hid, inter, topk, n = 512, 256, 4, 8
    pool = ExpertPool(make_arrays(n, hid, inter, 4, 64, mx.bfloat16), Quantization(4, 64))
    kb = K.KernelBackend(DIALECT, OpsBackend())
    x = mx.random.normal((1, 9, hid)).astype(mx.bfloat16)
    slots = make_slots(np.random.default_rng(0), 9, topk, n).reshape(1, 9, topk)
    assert "tokens" in kb.route(x, slots, pool, SwiGLU())
    assert mx.array_equal(
        kb(x, slots, pool, SwiGLU()), OpsBackend()(x, slots, pool, SwiGLU())
    ).item()


# ---------------------------------------------------------------------------------------------
# CPU (run everywhere): sources, text assembly, routing


def test_sources_load():
    for name in kernel_source.SOURCE_FILES:
        text = K.load_source(name)
        assert len(text) > 100, name
        assert name.endswith((".h", ".cuh", ".metal")), f"{name} would not ship as package data"
    with pytest.raises(KeyError):
        K.load_source("nope.h")


_DIALECT_TOKENS = {
    "cuda": (
        "threadIdx",
        "blockIdx",
        "__shfl",
        "__syncthreads",
        "__shared__",
        "__ldg",
        "__device__",
    ),
    "metal": (
        "simd_shuffle",
        "threadgroup_barrier",
        "thread_position_in",
        "threadgroup_position",
        "simdgroup_index",
        "as_type",
        "device uint",
        "metal::",
    ),
}


def _defined_names(text):
    return set(re.findall(r"#define\s+(MF_[A-Z0-9_]+)", text)) | set(
        re.findall(r"const int (MF_[A-Z0-9_]+)\s*=", text)
    )


@pytest.mark.parametrize(
    "kind,variant",
    [
        ("glu", "plain"),
        ("down", "plain"),
        ("combine", "plain"),
        ("combine", "shared"),
        ("combine", "gated"),
    ],
)
def test_kernel_text_assembly(kind, variant):
    shared = K.shared_body(kind, variant)
    common = K.load_source(kernel_source.COMMON)
    for text in (shared, common):  # the shared text names no dialect
        for tokens in _DIALECT_TOKENS.values():
            for tok in tokens:
                assert tok not in text, f"dialect token {tok!r} in the shared kernel text"
    used = set(re.findall(r"\bMF_[A-Z0-9_]+", shared + common))
    for dialect in K.DIALECTS:
        header, body = K.kernel_text(kind, dialect, variant)
        entry = K.load_source(kernel_source.ENTRY[dialect])
        assert body == entry + shared  # what runs on CUDA is what ships for Metal
        assert header.startswith(K.load_source(kernel_source.PRELUDE[dialect])) and header.endswith(
            common
        )
        missing = used - _defined_names(header + body)
        assert not missing, f"{dialect}: MF_ names used but not defined: {sorted(missing)}"
        other = "metal" if dialect == "cuda" else "cuda"
        for tok in _DIALECT_TOKENS[other]:
            assert tok not in header + body, f"{other} token {tok!r} in the {dialect} text"
    _, metal_body = K.kernel_text(kind, "metal", variant)
    for attr in (
        "thread_position_in_threadgroup",
        "thread_index_in_simdgroup",
        "simdgroup_index_in_threadgroup",
        "threadgroup_position_in_grid",
    ):
        assert attr in metal_body  # MLX adds the attribute because the body names it
    if kind in ("glu", "down"):
        for name in K._INPUTS[kind][2:]:
            assert f"{name}_strides" in shared  # pools are read through their strides
        # the row loop appears twice: 16-byte loads, and word-by-word loads for strided/unaligned pools
        assert shared.count("MF_LD(") == 2 * K.load_source(f"{kind}_rows.h").count("MF_LD(") + 2


def test_compact_reads_the_text_as_the_c_preprocessor_does():
    """Continued lines joined first, then comments gone (each a space), literals kept, blank
    lines and indentation dropped."""
    text = (
        '  a = "x // y /* z */";  // gone\n'
        "\n"
        "  /* two\n  lines */ #define MF_A 1 \\\n"
        "      + 2\n"
        "b /* inline */ c; char q = '\"'; // and \\\n"
        "  this continued comment\n"
        "d;\n"
    )
    assert kernel_source.compact(text) == (
        'a = "x // y /* z */";\n#define MF_A 1       + 2\nb   c; char q = \'"\';\nd;\n'
    )


_CPP = shutil.which("cpp")


@pytest.mark.skipif(_CPP is None, reason="no C preprocessor to tell tokens from comments")
@pytest.mark.parametrize("name", kernel_source.SOURCE_FILES)
def test_compacted_kernel_sources_keep_every_token(name):
    """What MLX is handed (``compact``) has every token of the source, line by line (a macro
    keeps its extent): both read by the C preprocessor's own comment removal
    (``-fpreprocessed``: no macro expanded), continued lines joined first, as C joins them."""

    def lines(text):
        out = subprocess.run(
            [_CPP, "-x", "c++", "-fpreprocessed", "-dD", "-E", "-P", "-"],
            input=text.replace("\\\n", ""),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        tokens = (re.findall(r'"(?:\\.|[^"\\\n])*"|\w+|\S', line) for line in out.splitlines())
        return [t for t in tokens if t]

    text = K.load_source(name)
    short = kernel_source.compact(text)
    assert lines(short) == lines(text)
    assert len(short) < len(text)


def test_kernel_names(monkeypatch):
    names = {
        K.kernel_name(k, d, v)
        for k, v in (
            ("glu", "plain"),
            ("down", "plain"),
            ("combine", "plain"),
            ("combine", "gated"),
        )
        for d in K.DIALECTS
    }
    assert len(names) == 8
    glu = K.kernel_name("glu", "cuda")
    assert re.fullmatch(r"moeflux_glu_[0-9a-f]{10}", glu)
    assert re.fullmatch(
        r"moeflux_combine_gated_[0-9a-f]{10}", K.kernel_name("combine", "cuda", "gated")
    )
    # the name follows the text: MLX's cache of compiled kernels (on disk, for CUDA) is keyed by
    # it, so an edited kernel must never be served the old binary
    real = K.kernel_text
    monkeypatch.setattr(K, "kernel_text", lambda *a: (real(*a)[0], real(*a)[1] + "\n// edited"))
    assert K.kernel_name("glu", "cuda") == glu  # a comment is not handed to MLX
    monkeypatch.setattr(K, "kernel_text", lambda *a: (real(*a)[0], real(*a)[1] + "\nint mf_e;"))
    edited = K.kernel_name("glu", "cuda")
    assert edited != glu and edited.startswith("moeflux_glu_")
    with pytest.raises(ValueError):
        K.kernel_text("glu", "vulkan")


def test_default_configs_cover_model_shapes():
    for hid, inter, topk in MODELS.values():
        for bits in (4, 8):
            for n_tok in (1, 8):
                g = K.default_config("glu", hid, inter, bits, n_tok * topk)
                K._check_config("glu", g, hid, bits)
                d = K.default_config("down", inter, hid, bits, n_tok * topk)
                K._check_config("down", d, inter, bits)


class _HalfSwiGLU(SwiGLU):
    def __call__(self, x, gate):
        return super().__call__(x, gate) * 0.5


def _cpu_pool(bits=4, gs=64, hid=256, inter=128, n=6, bias=False):
    with mx.stream(mx.cpu):
        arrays = make_arrays(n, hid, inter, bits, gs, mx.float32, seed=bits)
        if bias:
            arrays["down_proj.bias"] = mx.random.normal((n, hid))
    return ExpertPool(arrays, Quantization(bits, gs))


def test_backend_routing_and_fallback_cpu():
    kb = K.KernelBackend("cuda", OpsBackend())
    ops = OpsBackend()
    assert kb.name == "cuda"
    rng = np.random.default_rng(0)
    pool4 = _cpu_pool()
    x1 = mx.random.normal((1, 1, 256))
    s1 = make_slots(rng, 1, 4, 6).reshape(1, 1, 4)
    x9 = mx.random.normal((1, 9, 256))
    s9 = make_slots(rng, 9, 4, 6).reshape(1, 9, 4)
    # covered: the kernels would take it where the backend exists
    assert kb.route(x1, s1, pool4, SwiGLU(), assume_available=True) is None
    with mx.stream(mx.cpu):
        fc = ExpertPool(
            {
                **{
                    f"fc1.{k}": v
                    for k, v in zip(
                        ("weight", "scales", "biases"),
                        mx.quantize(mx.random.normal((6, 128, 256)), 64, 4),
                    )
                },
                **{
                    f"fc2.{k}": v
                    for k, v in zip(
                        ("weight", "scales", "biases"),
                        mx.quantize(mx.random.normal((6, 256, 128)), 64, 4),
                    )
                },
            },
            Quantization(4, 64),
        )
    cases = [
        ("tokens", x9, s9, pool4, SwiGLU()),
        ("quantization", x1, s1, _cpu_pool(bits=3), SwiGLU()),
        ("bias", x1, s1, _cpu_pool(bias=True), SwiGLU()),
        ("SwiGLU", x1, s1, pool4, _HalfSwiGLU()),
        ("gated", x1, s1, fc, nn.gelu),
    ]
    for why, x, s, pool, act in cases:
        reason = kb.route(x, s, pool, act, assume_available=True)
        assert reason is not None and why in reason, (why, reason)
        with mx.stream(mx.cpu):
            assert mx.array_equal(kb(x, s, pool, act), ops(x, s, pool, act)).item(), why
    if DIALECT is None:  # here nothing is available: even covered calls fall back, exactly
        assert "not available" in kb.route(x1, s1, pool4, SwiGLU())
        assert mx.array_equal(kb(x1, s1, pool4, SwiGLU()), ops(x1, s1, pool4, SwiGLU())).item()


def _byte_rows(arrays) -> dict:
    """Each array's experts as host byte rows ``[n, nbytes]``, as an expert file holds them."""
    rows = {}
    for name, a in arrays.items():
        raw = a if a.dtype == mx.uint32 else a.view(mx.uint16)
        rows[name] = np.array(raw).view(np.uint8).reshape(a.shape[0], -1)
    return rows


def _outside_the_pool(arrays, kept, experts):
    """A pool of experts ``kept`` (slot i holds expert kept[i]) of ``arrays``'s, and slots for
    ``experts`` [T, K]: the pool's slot where it holds the expert, else IN_PLACE_BIT | expert."""
    pool = {k: v[mx.array(kept)] for k, v in arrays.items()}
    where = {e: i for i, e in enumerate(kept)}
    slots = np.array([[where.get(e, IN_PLACE_BIT | e) for e in row] for row in experts], np.uint32)
    return pool, mx.array(slots)


def test_ops_read_experts_outside_the_pool_where_they_lie():
    """Slots with IN_PLACE_BIT name experts the pool does not hold: plain ops read them from
    ``InPlaceExperts``'s rows and compute what the whole layer computes, bit for bit."""
    with mx.stream(mx.cpu):
        arrays = make_arrays(8, 256, 128, 4, 64, mx.float32, seed=7)
        experts = np.array([[1, 5, 6, 2], [0, 5, 7, 3], [6, 4, 1, 2]])
        pool, slots = _outside_the_pool(arrays, [2, 5, 6], experts)
        where = InPlaceExperts({}, _byte_rows(arrays))
        wide = ExpertPool(pool, Quantization(4, 64), in_place=where)
        x = mx.random.normal((3, 256))
        want = OpsBackend()(x, mx.array(experts), ExpertPool(arrays, Quantization(4, 64)), SwiGLU())
        got = OpsBackend()(x, slots, wide, SwiGLU())
        assert mx.array_equal(got, want).item()
        # int32 slots alike, and a call naming none outside needs no rows
        assert mx.array_equal(OpsBackend()(x, slots.view(mx.int32), wide, SwiGLU()), want).item()
        inside = mx.array(np.array([[0, 1, 2, 0]] * 3, np.uint32))
        plain = OpsBackend()(x, inside, ExpertPool(pool, Quantization(4, 64)), SwiGLU())
        assert mx.array_equal(OpsBackend()(x, inside, wide, SwiGLU()), plain).item()


@pytest.mark.skipif(DIALECT != "cuda", reason="reading experts in place is CUDA's")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DNAME[d])
def test_cuda_kernels_read_experts_outside_the_pool_over_the_bus(dtype):
    """The CUDA kernels read a slot with IN_PLACE_BIT from page-locked host memory laid out as
    an expert file (``InPlaceExperts``'s addresses) and compute exactly what they compute for
    the same experts in the pool."""
    from moeflux_mlx.cuda.runtime import PinnedBuffer

    hid, inter, topk = MODELS["qwen3-30b-a3b"]
    n, n_tok = 12, 3
    arrays = make_arrays(n, hid, inter, 4, 64, dtype, seed=11)
    rows = _byte_rows(arrays)
    total = sum(r.size for r in rows.values())
    buf = PinnedBuffer(total + 16 * len(rows))
    try:
        addresses, off = {}, 0
        for name, r in rows.items():
            buf.array[off : off + r.size] = r.reshape(-1)
            addresses[name] = (buf.device_ptr + off, r.shape[1])
            off += -(-r.size // 16) * 16
        rng = np.random.default_rng(11)
        experts = np.stack([rng.choice(n, topk, replace=False) for _ in range(n_tok)])
        pool, slots = _outside_the_pool(arrays, [1, 4, 9, 0], experts)
        wide = ExpertPool(pool, Quantization(4, 64), in_place=InPlaceExperts(addresses, rows))
        x = mx.random.normal((1, n_tok, hid)).astype(dtype)
        kb = K.KernelBackend("cuda", OpsBackend())
        whole = ExpertPool(arrays, Quantization(4, 64))
        want = kb(x, mx.array(experts.reshape(1, n_tok, topk)), whole, SwiGLU())
        got = kb(x, slots.reshape(1, n_tok, topk), wide, SwiGLU())
        assert kb.last_served == "cuda"
        assert mx.array_equal(got, want).item()
    finally:
        mx.synchronize()
        buf.close()


def test_backend_plans_once_per_pool_and_shape():
    """Routing is worked out once per pool and call shape; a fallback decision is kept too."""
    kb = K.KernelBackend("cuda", OpsBackend())
    calls = []
    route = kb.route
    kb.route = lambda *a, **k: calls.append(a[0].shape) or route(*a, **k)
    pool = _cpu_pool()
    rng = np.random.default_rng(1)
    for n_tok in (1, 1, 2, 1, 2):
        x = mx.random.normal((1, n_tok, 256))
        s = make_slots(rng, n_tok, 4, 6).reshape(1, n_tok, 4)
        with mx.stream(mx.cpu):
            assert mx.array_equal(
                kb(x, s, pool, SwiGLU()), OpsBackend()(x, s, pool, SwiGLU())
            ).item()
    assert calls == [(1, 1, 256), (1, 2, 256)]
    assert len(pool.plans) == 2 and all(p.launches is None for p in pool.plans.values())  # no GPU
    other = _cpu_pool()
    kb(mx.random.normal((1, 1, 256)), s[:, :1], other, SwiGLU())
    assert len(calls) == 3 and len(other.plans) == 1  # a new pool plans anew


def _faked_backend(monkeypatch):
    """A CUDA ``KernelBackend`` whose launches are recorded (kind, inputs, output shape) and
    return zeros, with a pool and an x to call it on: the Python around the kernels, anywhere."""
    launched = []

    def fake_kernel(kind, dialect, variant="plain"):
        def run(inputs, output_shapes, output_dtypes, **kw):
            launched.append((kind, inputs, output_shapes[0]))
            return [mx.zeros(output_shapes[0], output_dtypes[0])]

        return run

    monkeypatch.setattr(K, "_kernel", fake_kernel)
    kb = K.KernelBackend("cuda", OpsBackend(), selfcheck=False)
    kb._available = True
    return kb, launched, _cpu_pool(), mx.random.normal((1, 1, 256))


def test_backend_adds_two_graph_nodes(monkeypatch):
    """Decode is bound by the host's work per graph node (docs/kernels.md): the backend hands
    x and the router's slots to the two launches as they are, with no copy or reshape node, and
    declares outputs already shaped like SwitchGLU's."""
    kb, launched, pool, x = _faked_backend(monkeypatch)
    slots = mx.argpartition(mx.random.normal((1, 1, 6)), kth=-4, axis=-1)[..., -4:]
    out = kb(x, slots, pool, SwiGLU())
    (g, (gx, gs, *_), gshape), (d, (_, ds, *_), dshape) = launched
    assert (g, d) == ("glu", "down") and gx is x and gs is slots and ds is slots
    assert gshape == (1, 1, 4, 128) and dshape == out.shape == (1, 1, 4, 256)


def test_backend_casts_only_slots_the_kernels_cannot_read(monkeypatch):
    """Slots the kernels read as slot numbers (int32, uint32) go to both launches as they are;
    others are cast once, to int32: the plan of each slots dtype says which."""
    kb, launched, pool, x = _faked_backend(monkeypatch)
    for dtype in (mx.uint32, mx.int64, mx.int32, mx.int64, mx.uint32):
        slots = mx.array([[[0, 1, 2, 3]]], dtype=dtype)
        launched.clear()
        kb(x, slots, pool, SwiGLU())
        glu_slots, down_slots = (inputs[1] for _, inputs, _ in launched)
        assert glu_slots is down_slots
        if dtype in K.SLOT_DTYPES:
            assert glu_slots is slots
        else:
            assert glu_slots.dtype == mx.int32 and mx.array_equal(glu_slots, slots).item()
    assert len(pool.plans) == 3 and kb.last_served == "cuda"


def test_wrappers_validate_before_launch():
    pool = _cpu_pool()
    x = mx.random.normal((1, 256))
    s = mx.array([[0, 1, 2, 3]], dtype=mx.int32)
    with pytest.raises(ValueError):
        K.glu_matvec(x, pool.arrays, s, bits=3, group_size=64, dialect="cuda")
    with pytest.raises(ValueError):
        K.glu_matvec(x, pool.arrays, s, bits=4, group_size=32, dialect="cuda")  # shapes say 64
    with pytest.raises(ValueError):
        K.glu_matvec(x, pool.arrays, s, bits=4, group_size=64, dialect="opencl")
    with pytest.raises(ValueError):
        K.down_matvec(mx.zeros((1, 3, 128)), pool.arrays, s, bits=4, group_size=64, dialect="cuda")
    with pytest.raises(ValueError):
        K.combine(mx.zeros((1, 8)), mx.zeros((1, 2, 8)), mx.zeros((1, 3)), dialect="cuda")
