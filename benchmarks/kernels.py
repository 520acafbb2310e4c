"""Fused expert kernels vs the mx.gather_qmm path (compute.ops.OpsBackend), decode (T=1), real MoE shapes.

For each model shape: one pool of random 4-bit experts much larger than the L2 (rotating among
random expert sets so weights are not L2-resident), timed in one run:
  * the kernels alone (GLU, down, combine), with a sweep of launch shapes (--sweep),
  * the fused path: GLU + down (the K-expert FFN) and GLU + down + combine,
  * the gather_qmm path on the same pool and slots: OpsBackend (FFN) and OpsBackend + mlx combine.
Timing: each sample evaluates a batch of independent calls (different experts and inputs) between
mx.synchronize() calls and divides by the batch; warm-up first (CUDA kernels compile at first use);
medians over samples. Effective GB/s = bytes of expert weights + scales + biases the call must read
/ time. A device copy gives the memory ceiling of the same run.

--mxfp4 adds, per model, a pool of random mxfp4 experts (gpt-oss's format: 4-bit e2m1 weights,
one uint8 e8m0 scale per 32, no quantization biases) timed through OpsBackend, i.e. the
mx.gather_qmm(mode="mxfp4") calls moeflux's plain-ops path makes: plain SwiGLU, and as gpt-oss
computes it (expert bias vectors, the clamped SwigluOAI). Beside it, from the same run: the
affine fused FFN and affine gather_qmm on the same shape, and the device copy. Fused-affine GB/s
/ gather_qmm-mxfp4 GB/s is the most a fused mxfp4 kernel could gain. Where the fused kernels do
not take the shape (hidden 2880 in 4-bit is 90 16-byte chunks a row, which no launch shape of
theirs divides), the report says why and takes the fused figure from the nearest larger shape
they take (a proxy: GB/s, not µs, carry over). Without a GPU (MLX's CPU backend) the fused kernels
are skipped with a note and everything else runs (--smoke: a few seconds, for the tests).

    python benchmarks/kernels.py --sweep --out benchmarks/results --tag h100
    python benchmarks/kernels.py --models gpt-oss-120b --mxfp4 --out benchmarks/results --tag h100
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.activations import SwigluOAI
from mlx_lm.models.switch_layers import SwiGLU

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moeflux_mlx.cache.pool import ExpertPool  # noqa: E402
from moeflux_mlx.compute import kernels as K  # noqa: E402
from moeflux_mlx.compute.backend import gpu_dialect  # noqa: E402
from moeflux_mlx.compute.kernels import ExpertSpec  # noqa: E402
from moeflux_mlx.compute.ops import OpsBackend  # noqa: E402
from moeflux_mlx.format.layout import Quantization  # noqa: E402

MODELS = {  # hidden, intermediate, routed experts per token
    "qwen3-30b-a3b": (2048, 768, 8),
    "qwen3.5-397b-a17b": (4096, 1024, 10),
    "deepseek-v3": (7168, 2048, 8),
    "gpt-oss-120b": (2880, 2880, 4),  # 128 experts a layer; ships mxfp4 (--mxfp4)
}
MXFP4 = Quantization(4, 32, "mxfp4")
N_SETS = 64  # random calls each timing rotates over (different experts and inputs)
NO_GPU = "no Metal or CUDA GPU (MLX's CPU backend): the fused kernels do not run here"


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return str(mx.device_info().get("device_name", "unknown"))
    except Exception:  # noqa: BLE001
        return "unknown"


def random_words(shape):
    return mx.random.randint(-(2**31), 2**31 - 1, shape, dtype=mx.int32).view(mx.uint32)


def projections(hid, inter):
    """``(projection, (out, in))`` of a gated expert."""
    return (("gate_proj", (inter, hid)), ("up_proj", (inter, hid)), ("down_proj", (hid, inter)))


def make_pool(n, hid, inter, bits, gs, dtype):
    """Random packed weights (every bit pattern is a valid quantized weight), random scales."""
    arrays = {}
    for proj, (o, i) in projections(hid, inter):
        arrays[f"{proj}.weight"] = random_words((n, o, i * bits // 32))
        arrays[f"{proj}.scales"] = (mx.random.uniform(0.5, 1.5, (n, o, i // gs)) * 0.01).astype(
            dtype
        )
        arrays[f"{proj}.biases"] = (mx.random.normal((n, o, i // gs)) * 0.01).astype(dtype)
        mx.eval(arrays)
    return ExpertPool(arrays, Quantization(bits, gs))


def make_mxfp4_pool(n, hid, inter, dtype, expert_bias=False):
    """Random mxfp4 experts: every 4-bit code is a valid e2m1 value; scales are e8m0 exponents
    of 2^-9 .. 2^-1 (uint8 127 is 2^0; 255 would be NaN). ``expert_bias``: gpt-oss's bias
    vectors (``*.bias``, one per output row), which its plain-ops path adds after each matmul."""
    arrays = {}
    for proj, (o, i) in projections(hid, inter):
        arrays[f"{proj}.weight"] = random_words((n, o, i * 4 // 32))
        arrays[f"{proj}.scales"] = mx.random.randint(118, 127, (n, o, i // 32)).astype(mx.uint8)
        if expert_bias:
            arrays[f"{proj}.bias"] = (mx.random.normal((n, o)) * 0.01).astype(dtype)
        mx.eval(arrays)
    return ExpertPool(arrays, MXFP4)


def affine_spec(hid, inter, bits, gs, dtype=mx.bfloat16) -> ExpertSpec:
    """The shapes of an affine pool, no arrays: what the fused kernels' coverage depends on."""
    shapes = {}
    for proj, (o, i) in projections(hid, inter):
        shapes[f"{proj}.weight"] = (mx.uint32, (o, i * bits // 32))
        shapes[f"{proj}.scales"] = (dtype, (o, i // gs))
        shapes[f"{proj}.biases"] = (dtype, (o, i // gs))
    return ExpertSpec(shapes, Quantization(bits, gs))


def fused_refusal(hid, inter, bits, gs, dialect):
    """Why the fused kernels do not take this shape (None: they do), as the runtime decides it
    (``compute.kernels.expert_route``); on the CPU, for the dialect a GPU here would have."""
    return K.expert_route(dialect or gpu_dialect(), affine_spec(hid, inter, bits, gs), SwiGLU())


MAX_CHUNKS_PER_LANE = 16  # more 16-byte loads per lane and row spill (kernels.default_config)


def covered_proxy(hid, inter, bits, gs, dialect):
    """The smallest (H', I') >= (H, I), in whole groups, that the fused kernels take with a lean
    default launch (at most ``MAX_CHUNKS_PER_LANE`` chunks per lane and row: a row length they
    take only with one or two lanes a row would time a spilling kernel, not the kernels' best):
    a shape of about the same bytes per row to read their GB/s from. None: none up to 2x."""

    def lean(kind, in_dim, out_dim):
        cfg = K.default_config(kind, in_dim, out_dim, bits, 1)
        return in_dim * bits // 128 // cfg["lpr"] <= MAX_CHUNKS_PER_LANE

    def sizes(d):
        return range(d, 2 * d + 1, gs)

    fits = [
        (h, i)
        for h in sizes(hid)
        for i in sizes(inter)
        if fused_refusal(h, i, bits, gs, dialect) is None
        and lean("glu", h, i)
        and lean("down", i, h)
    ]
    return min(fits, key=lambda hi: (hi[0] * hi[1], hi), default=None)


def expert_bytes(pool, keys=None):
    return sum(
        v.nbytes // v.shape[0]
        for k, v in pool.arrays.items()
        if keys is None or k.split(".")[0] in keys
    )


def timeit(make, n_sets, reps, batch):
    """Median seconds per call; make(i) builds (lazily) call i."""
    for w in range(2):
        mx.eval([make((w * batch + i) % n_sets) for i in range(batch)])
    mx.synchronize()
    samples = []
    for r in range(reps):
        outs = [make((r * batch + i) % n_sets) for i in range(batch)]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples), min(samples)


def time_chain(step, x0, n_sets, reps, batch):
    """Median seconds per step of a dependent chain x <- step(i, x) (one decode layer after
    another: each call waits for the one before, as in a real forward pass)."""

    def chain(off):
        x = x0
        for i in range(batch):
            x = step((off + i) % n_sets, x)
        return x

    for w in range(2):
        mx.eval(chain(w * batch))
    mx.synchronize()
    samples = []
    for r in range(reps):
        out = chain(r * batch)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples), min(samples)


def copy_bandwidth(mb=1024.0):
    a = random_words((int(mb * 2**20) // 4,))  # default 1 GiB
    mx.eval(a)
    t, _ = timeit(lambda i: a + mx.array(i + 1, dtype=mx.uint32), 4, 10, 2)
    return 2 * a.nbytes / t / 1e9


def sweep_configs(kind, in_dim, bits, full):
    """Launch shapes to time: a full grid, or a few alternatives around the default."""
    nch = in_dim * bits // 128
    out = []
    if kind == "glu":
        shapes = ((4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (2, 4)) if full else ((4, 1), (8, 2))
        for lpr in (32, 16, 8) if full else (32, 16):
            if nch % lpr == 0:
                out += [dict(lpr=lpr, nw=nw, rpw=rpw) for nw, rpw in shapes]
    else:
        shapes = (
            ((4, 1, 1), (4, 1, 2), (4, 2, 2), (4, 1, 4), (8, 1, 2), (2, 2, 2))
            if full
            else ((4, 1, 2), (4, 1, 4))
        )
        for lpr in (32, 16, 8, 4) if full else (8, 4):
            if nch % lpr == 0:
                out += [dict(lpr=lpr, nw=nw, rpw=rpw, nr=nr) for nw, rpw, nr in shapes]
    return out


class Calls:
    """``n`` random decode calls (one token each) into a pool of ``n_slots`` experts: slots,
    x, h (down's input), residual, routing weights, y (combine's input)."""

    def __init__(self, n_slots, hid, inter, topk, dtype, n=N_SETS):
        self.slots = [
            mx.random.permutation(n_slots)[:topk].reshape(1, topk).astype(mx.int32)
            for _ in range(n)
        ]
        self.xs = [mx.random.normal((1, hid)).astype(dtype) for _ in range(n)]
        self.hs = [mx.random.normal((1, topk, inter)).astype(dtype) for _ in range(n)]
        self.rs = [mx.random.normal((1, hid)).astype(dtype) for _ in range(n)]
        self.ws = [mx.softmax(mx.random.normal((1, topk)), axis=-1).astype(dtype) for _ in range(n)]
        self.ys = [mx.random.normal((1, topk, hid)).astype(dtype) for _ in range(n)]
        mx.eval(self.slots, self.xs, self.hs, self.rs, self.ws, self.ys)


def log_timings(log, timings, gbs):
    """One line per path: median µs, and GB/s where it has bytes."""
    for k, (med, _) in timings.items():
        log(f"   {k:24s} {med * 1e6:8.1f} us" + (f"  {_gbs(gbs[k]):>7} GB/s" if k in gbs else ""))


def pool_slots(probe, topk, pool_mb):
    """(slots, bytes per expert) of a pool of ``pool_mb`` MB (at least 4 x top-k experts)."""
    per_expert = expert_bytes(probe)
    return max(4 * topk, math.ceil(pool_mb * 1e6 / per_expert)), per_expert


def run_model(name, args, dialect, log):
    hid, inter, topk = MODELS[name]
    return run_shape(name, hid, inter, topk, args, dialect, log, mxfp4=args.mxfp4)


def run_shape(name, hid, inter, topk, args, dialect, log, mxfp4=False):
    """Every timing of one shape: the gather_qmm path (always), the fused kernels (on a GPU,
    where they take the shape), and with ``mxfp4`` the mxfp4 comparison (``run_mxfp4``)."""
    bits, gs, dtype = args.bits, args.group_size, mx.bfloat16
    n_slots, per_expert = pool_slots(make_pool(1, hid, inter, bits, gs, dtype), topk, args.pool_mb)
    pool = make_pool(n_slots, hid, inter, bits, gs, dtype)
    c = Calls(n_slots, hid, inter, topk, dtype)
    glu_bytes = topk * expert_bytes(pool, ("gate_proj", "up_proj"))
    down_bytes = topk * expert_bytes(pool, ("down_proj",))
    ffn_bytes = glu_bytes + down_bytes
    refusal = fused_refusal(hid, inter, bits, gs, dialect)
    res = dict(
        model=name,
        hidden=hid,
        intermediate=inter,
        topk=topk,
        bits=bits,
        group_size=gs,
        pool_slots=n_slots,
        pool_mb=round(n_slots * per_expert / 1e6),
        expert_bytes=per_expert,
        ffn_bytes=ffn_bytes,
        fused_refusal=refusal,  # why the fused kernels refuse this shape on a GPU, or None
    )
    # None: the fused kernels were timed; else why not (no GPU, or the shape's refusal)
    res["fused"] = None if refusal is None else f"they do not take this shape: {refusal}"
    if dialect is None:
        res["fused"] = NO_GPU + (f"; on a GPU, {res['fused']}" if refusal else "")
    log(
        f"== {name}: H={hid} I={inter} K={topk}, pool {n_slots} experts "
        f"({res['pool_mb']} MB), {ffn_bytes / 1e6:.1f} MB read per token"
    )
    if refusal is not None:
        log(f"   fused kernels do not take this shape: {refusal}")

    ops, act = OpsBackend(), SwiGLU()

    def ops_ffn(i):
        return ops(c.xs[i], c.slots[i], pool, act)

    def ops_all(i):
        y = ops_ffn(i)
        return c.rs[i] + (y * c.ws[i][..., None]).sum(axis=-2).astype(y.dtype)

    def ops_layer(i, x):
        y = ops(x, c.slots[i], pool, act)
        return x + (y * c.ws[i][..., None]).sum(axis=-2).astype(y.dtype)

    timings = {
        "gather_qmm_ffn": timeit(ops_ffn, N_SETS, args.reps, args.batch),
        "gather_qmm_ffn_combine": timeit(ops_all, N_SETS, args.reps, args.batch),
        "gather_qmm_layer_chained": time_chain(ops_layer, c.xs[0], N_SETS, args.reps, args.batch),
    }
    if res["fused"] is None:
        timings.update(fused_timings(res, pool, c, ops_ffn, args, dialect, log))
    nbytes = dict(glu=glu_bytes, down=down_bytes, combine=None)
    res["us"] = {k: v[0] * 1e6 for k, v in timings.items()}
    res["min_us"] = {k: v[1] * 1e6 for k, v in timings.items()}
    res["gbs"] = {
        k: nbytes.get(k, ffn_bytes) / v[0] / 1e9
        for k, v in timings.items()
        if nbytes.get(k, ffn_bytes) is not None
    }
    if res["fused"] is None:
        for key, fused, ref in (
            ("speedup_chained", "fused_layer_chained", "gather_qmm_layer_chained"),
            ("speedup_ffn", "fused_ffn", "gather_qmm_ffn"),
            ("speedup_ffn_combine", "fused_ffn_combine", "gather_qmm_ffn_combine"),
        ):
            res[key] = timings[ref][0] / timings[fused][0]
    log_timings(log, timings, res["gbs"])
    if mxfp4:
        res["mxfp4"] = run_mxfp4(res, args, dialect, log)
    mx.clear_cache()
    return res


def fused_timings(res, pool, c, ops_ffn, args, dialect, log):
    """The fused kernels on ``pool``: a launch-shape sweep of each kernel alone (``--sweep``),
    then GLU + down (+ combine, + chained) at the best shapes; fills ``res``'s sweeps, best
    shapes and the fused-vs-gather_qmm difference, returns the timings."""
    name, hid, inter, topk = res["model"], res["hidden"], res["intermediate"], res["topk"]
    bits, gs = res["bits"], res["group_size"]
    glu_bytes = topk * expert_bytes(pool, ("gate_proj", "up_proj"))
    down_bytes = topk * expert_bytes(pool, ("down_proj",))
    a = pool.arrays
    q = dict(bits=bits, group_size=gs, dialect=dialect)

    def t(make):
        return timeit(make, N_SETS, args.reps, args.batch)

    # --- launch-shape sweep, each kernel alone
    best = {}
    for kind, in_dim, out_dim, nbytes in (
        ("glu", hid, inter, glu_bytes),
        ("down", inter, hid, down_bytes),
    ):
        cfgs = (
            sweep_configs(kind, in_dim, bits, full=name in args.sweep_models) if args.sweep else []
        )
        default = K.default_config(kind, in_dim, out_dim, bits, topk)
        if default not in cfgs:
            cfgs.append(default)
        rows = []
        for cfg in cfgs:
            if kind == "glu":
                make = lambda i, g=cfg: K.glu_matvec(c.xs[i], a, c.slots[i], config=g, **q)  # noqa: E731
            else:
                make = lambda i, g=cfg: K.down_matvec(c.hs[i], a, c.slots[i], config=g, **q)  # noqa: E731
            med, mn = t(make)
            rows.append(
                dict(
                    config=cfg,
                    us=med * 1e6,
                    min_us=mn * 1e6,
                    gbs=nbytes / med / 1e9,
                    default=cfg == default,
                )
            )
            log(
                f"   {kind:5s} {json.dumps(cfg):48s} {med * 1e6:8.1f} us  {_gbs(nbytes / med / 1e9):>7} GB/s"
                + ("  (default)" if cfg == default else "")
            )
        rows.sort(key=lambda r: r["us"])
        res[f"{kind}_sweep"] = rows
        best[kind] = rows[0]["config"]
    res["best_config"] = best

    # --- paths (best launch shapes), same pool, same experts
    gcfg, dcfg = best["glu"], best["down"]

    def fused_ffn_x(i, x):
        h = K.glu_matvec(x, a, c.slots[i], config=gcfg, **q)
        return K.down_matvec(h, a, c.slots[i], config=dcfg, **q)

    def fused_ffn(i):
        return fused_ffn_x(i, c.xs[i])

    def fused_all(i):
        return K.combine(c.rs[i], fused_ffn(i), c.ws[i], dialect=dialect)

    # dependent chain: residual stream through FFN + combine, layer after layer
    def fused_layer(i, x):
        return K.combine(x, fused_ffn_x(i, x), c.ws[i], dialect=dialect)

    timings = {
        "glu": t(lambda i: K.glu_matvec(c.xs[i], a, c.slots[i], config=gcfg, **q)),
        "down": t(lambda i: K.down_matvec(c.hs[i], a, c.slots[i], config=dcfg, **q)),
        "combine": t(lambda i: K.combine(c.rs[i], c.ys[i], c.ws[i], dialect=dialect)),
        "fused_ffn": t(fused_ffn),
        "fused_ffn_combine": t(fused_all),
        "fused_layer_chained": time_chain(fused_layer, c.xs[0], N_SETS, args.reps, args.batch),
    }
    # the two paths must agree (same weights, same experts)
    ref = ops_ffn(0).reshape(1, topk, hid).astype(mx.float32)
    err = mx.abs(fused_ffn(0).astype(mx.float32) - ref)
    res["fused_vs_gather_qmm_max_abs"] = float(err.max().item())
    res["gather_qmm_max_abs"] = float(mx.abs(ref).max().item())
    return timings


def run_mxfp4(affine, args, dialect, log):
    """The mxfp4 comparison on ``affine``'s shape (``run_shape``'s result, same run): mxfp4
    experts through OpsBackend, plain SwiGLU and gpt-oss's path (bias vectors, SwigluOAI), and
    what bounds a fused mxfp4 kernel: the fused affine kernels' GB/s on this shape, else on the
    nearest shape they take (``covered_proxy``)."""
    name, hid, inter, topk = (
        affine["model"],
        affine["hidden"],
        affine["intermediate"],
        affine["topk"],
    )
    dtype = mx.bfloat16
    n_slots, per_expert = pool_slots(make_mxfp4_pool(1, hid, inter, dtype), topk, args.pool_mb)
    gpt_oss = make_mxfp4_pool(n_slots, hid, inter, dtype, expert_bias=True)
    plain = ExpertPool({k: v for k, v in gpt_oss.arrays.items() if not k.endswith(".bias")}, MXFP4)
    c = Calls(n_slots, hid, inter, topk, dtype)
    ops = OpsBackend()
    paths = {
        "gather_qmm_mxfp4_ffn": (plain, SwiGLU()),
        "ops_mxfp4_gpt_oss_ffn": (gpt_oss, SwigluOAI()),
    }
    nbytes = {k: topk * expert_bytes(pool) for k, (pool, _) in paths.items()}
    timings = {
        k: timeit(
            lambda i, p=pool, f=act: ops(c.xs[i], c.slots[i], p, f), N_SETS, args.reps, args.batch
        )
        for k, (pool, act) in paths.items()
    }
    out = dict(
        pool_slots=n_slots,
        pool_mb=round(n_slots * per_expert / 1e6),
        expert_bytes=per_expert,
        ffn_bytes=nbytes["gather_qmm_mxfp4_ffn"],
        gpt_oss_ffn_bytes=nbytes["ops_mxfp4_gpt_oss_ffn"],
        us={k: v[0] * 1e6 for k, v in timings.items()},
        min_us={k: v[1] * 1e6 for k, v in timings.items()},
        gbs={k: nbytes[k] / v[0] / 1e9 for k, v in timings.items()},
        finite=all(
            bool(mx.isfinite(ops(c.xs[0], c.slots[0], pool, act)).all().item())
            for pool, act in paths.values()
        ),
        gather_qmm_affine_gbs=affine["gbs"]["gather_qmm_ffn"],
        fused_affine_gbs=None,
        fused_affine_source=None,
    )
    log_timings(log, timings, out["gbs"])
    proxy = None
    if affine["fused_refusal"] is not None:
        proxy = covered_proxy(hid, inter, args.bits, args.group_size, dialect)
        out["proxy_shape"] = proxy
    if affine["fused"] is None:
        out["fused_affine_gbs"] = affine["gbs"]["fused_ffn"]
        out["fused_affine_source"] = "same shape"
    elif proxy is None or dialect is None:
        out["fused_affine_source"] = affine["fused"] + (
            "" if proxy or dialect is None else "; no shape up to 2x larger is taken either"
        )
    else:
        log(f"   fused affine figure from the nearest shape they take: H={proxy[0]} I={proxy[1]}")
        got = run_shape(f"{name} (proxy)", proxy[0], proxy[1], topk, args, dialect, log)
        out["fused_affine_gbs"] = got["gbs"]["fused_ffn"]
        out["fused_affine_source"] = f"proxy shape H={proxy[0]} I={proxy[1]} ({affine['fused']})"
        out["proxy"] = {k: got[k] for k in ("hidden", "intermediate", "ffn_bytes", "us", "gbs")}
    fused = out["fused_affine_gbs"]
    # the decision: a fused mxfp4 kernel reads about the bytes gather_qmm reads, at best as
    # fast as the fused affine kernels read theirs
    out["max_gain"] = fused / out["gbs"]["gather_qmm_mxfp4_ffn"] if fused else None
    out["max_gain_vs_gpt_oss_ops"] = fused / out["gbs"]["ops_mxfp4_gpt_oss_ffn"] if fused else None
    if out["max_gain"] is not None:
        log(f"   most a fused mxfp4 kernel could gain: {out['max_gain']:.2f}x")
    else:
        log(f"   most a fused mxfp4 kernel could gain: not measured ({out['fused_affine_source']})")
    return out


def _profiler(start: bool) -> int:
    """cuProfilerStart/Stop, so that ncu --profile-from-start off sees only the region."""
    import ctypes

    rc = -1
    for name, fn in (
        ("libcuda.so.1", "cuProfiler"),
        ("libcudart.so.13", "cudaProfiler"),
        ("libcudart.so", "cudaProfiler"),
    ):
        try:
            lib = ctypes.CDLL(name)
            rc = int(getattr(lib, fn + ("Start" if start else "Stop"))())
        except (OSError, AttributeError):
            continue
        if rc == 0:
            return rc
    return rc


def ncu_region(name, args, dialect, configs):
    """Run each path --ncu-calls times inside a profiler region (for ncu kernel durations)."""
    hid, inter, topk = MODELS[name]
    bits, gs, dtype = args.bits, args.group_size, mx.bfloat16
    n_slots = 4 * topk
    pool = make_pool(n_slots, hid, inter, bits, gs, dtype)
    a, q, ops, act = (
        pool.arrays,
        dict(bits=bits, group_size=gs, dialect=dialect),
        OpsBackend(),
        SwiGLU(),
    )
    gcfg, dcfg = configs.get(name, {}).get("glu"), configs.get(name, {}).get("down")
    n = args.ncu_calls
    sets = [
        mx.random.permutation(n_slots)[:topk].reshape(1, topk).astype(mx.int32) for _ in range(n)
    ]
    xs = [mx.random.normal((1, hid)).astype(dtype) for _ in range(n)]
    mx.eval(sets, xs)

    def fused(i):
        h = K.glu_matvec(xs[i], a, sets[i], config=gcfg, **q)
        return K.down_matvec(h, a, sets[i], config=dcfg, **q)

    def gqmm(i):
        return ops(xs[i], sets[i], pool, act)

    for f in (fused, gqmm):  # compile and warm up outside the region
        mx.eval(f(0))
    mx.synchronize()
    rc = _profiler(True)
    for f in (fused, gqmm):
        for i in range(n):
            mx.eval(f(i))
            mx.synchronize()
    _profiler(False)
    print(f"ncu region for {name}: cuProfilerStart rc={rc}, {n} calls per path", flush=True)


def parse_ncu(path: Path, n_calls: int) -> str:
    """Summarize `ncu --csv --metrics gpu__time_duration.sum` output: GPU µs per call and kernel."""
    import csv

    rows = [
        r
        for r in csv.reader(line for line in path.read_text().splitlines() if line.startswith('"'))
    ]
    head, body = rows[0], rows[1:]
    ki, ui, vi = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
    per = {}
    for r in body:
        v = float(r[vi].replace(",", ""))
        v = v / 1e3 if r[ui].startswith("n") else v * 1e3 if r[ui].startswith("m") else v
        per.setdefault(r[ki][:90], []).append(v)
    lines = ["| kernel | launches | median µs | µs per call |", "|---|---|---|---|"]
    fused = ops = 0.0
    for k, vs in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        per_call = statistics.median(vs) * max(1, round(len(vs) / n_calls))
        if "moeflux" in k:
            fused += per_call
        else:
            ops += per_call
        lines.append(f"| `{k}` | {len(vs)} | {statistics.median(vs):.1f} | {per_call:.1f} |")
    lines.append(
        f"\nGPU time per call: fused GLU+down {fused:.1f} µs, gather_qmm path {ops:.1f} µs "
        f"(ratio {ops / fused if fused else float('nan'):.1f}×)"
    )
    return "\n".join(lines) + "\n"


def _fmt(value, spec: str, suffix: str = "") -> str:
    """A table cell: ``value`` formatted, or n/a where nothing was measured."""
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _gbs(value) -> str:
    """GB/s: whole numbers on a GPU; the CPU's fractions keep two digits."""
    if value is None:
        return "n/a"
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def mxfp4_markdown(meta, results):
    """The mxfp4 section: gather_qmm on mxfp4 experts beside the affine paths of the same run."""
    rows = [r for r in results if "mxfp4" in r]
    lines = [
        "",
        "## mxfp4 experts (gpt-oss's format): is a fused mxfp4 kernel worth it?",
        "",
        "mxfp4 = 4-bit e2m1 weights + one uint8 e8m0 scale per 32 weights, no quantization "
        'biases; timed through OpsBackend, i.e. the `mx.gather_qmm(mode="mxfp4")` calls of '
        "moeflux's plain-ops path: with plain SwiGLU, and as gpt-oss computes it (expert bias "
        "vectors, clamped SwigluOAI). GB/s = bytes of weights + scales (+ bias vectors) read per "
        f"call / time. Same run: affine {meta['bits']}-bit group {meta['group_size']} on the same "
        f"shape (gather_qmm, fused kernels) and the device copy ({_gbs(meta['copy_gbs'])} GB/s). "
        "**Most a fused mxfp4 kernel could gain = fused affine GB/s ÷ gather_qmm mxfp4 GB/s** "
        "(it would read about the bytes gather_qmm reads, at best as fast as the fused affine "
        "kernels read theirs).",
        "",
        "| model (H, I, K) | mxfp4 MB/token | gather_qmm mxfp4 µs | GB/s | gpt-oss ops path µs "
        "| GB/s | affine gather_qmm GB/s | fused affine GB/s | copy GB/s "
        "| most a fused mxfp4 kernel could gain | ÷ gpt-oss ops path |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["mxfp4"]
        us, g = m["us"], m["gbs"]
        lines.append(
            f"| {r['model']} ({r['hidden']}, {r['intermediate']}, {r['topk']}) "
            f"| {m['ffn_bytes'] / 1e6:.1f} | {us['gather_qmm_mxfp4_ffn']:.1f} "
            f"| {_gbs(g['gather_qmm_mxfp4_ffn'])} | {us['ops_mxfp4_gpt_oss_ffn']:.1f} "
            f"| {_gbs(g['ops_mxfp4_gpt_oss_ffn'])} | {_gbs(m['gather_qmm_affine_gbs'])} "
            f"| {_gbs(m['fused_affine_gbs'])} | {_gbs(meta['copy_gbs'])} "
            f"| {_fmt(m['max_gain'], '.2f', '×')} | {_fmt(m['max_gain_vs_gpt_oss_ops'], '.2f', '×')} |"
        )
    lines.append("")
    for r in rows:
        m = r["mxfp4"]
        proxy = m.get("proxy_shape")
        lines.append(
            f"- {r['model']}: fused affine figure: {m['fused_affine_source']}"
            + (
                f" (on a GPU: from the proxy shape H={proxy[0]} I={proxy[1]})"
                if proxy and m["fused_affine_gbs"] is None
                else ""
            )
            + ("" if m["finite"] else "; **mxfp4 outputs not finite**")
        )
    return lines


def markdown(meta, results):
    lines = [
        f"# Fused expert kernels vs gather_qmm — {meta['gpu']} ({meta['date']})",
        "",
        f"MLX {meta['mlx']}, dialect `{meta['dialect']}`, {meta['bits']}-bit group {meta['group_size']}, "
        f"bf16 activations, T=1 (decode). Medians of {meta['reps']} samples × {meta['batch']} calls; "
        f"weights rotate over a pool of ≥ {meta['pool_mb']} MB (L2 is 50 MB). "
        f"Device copy in the same run: {_gbs(meta['copy_gbs'])} GB/s (read + write).",
        "",
        "GB/s = bytes of expert weights + scales + biases read per call / time; n/a: not timed "
        "(the notes below say why).",
        "",
        "| model (H, I, K) | MB/token | GLU µs | down µs | combine µs | fused FFN µs "
        "| fused FFN GB/s | gather_qmm FFN µs | gather_qmm GB/s | speed-up FFN "
        "| fused +combine µs | gather_qmm +combine µs | speed-up +combine |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        us, g = r["us"], r["gbs"]
        lines.append(
            f"| {r['model']} ({r['hidden']}, {r['intermediate']}, {r['topk']}) | {r['ffn_bytes'] / 1e6:.1f} "
            f"| {_fmt(us.get('glu'), '.1f')} | {_fmt(us.get('down'), '.1f')} "
            f"| {_fmt(us.get('combine'), '.1f')} | {_fmt(us.get('fused_ffn'), '.1f')} "
            f"| {_gbs(g.get('fused_ffn'))} | {us['gather_qmm_ffn']:.1f} | {_gbs(g['gather_qmm_ffn'])} "
            f"| {_fmt(r.get('speedup_ffn'), '.1f', '×')} | {_fmt(us.get('fused_ffn_combine'), '.1f')} "
            f"| {us['gather_qmm_ffn_combine']:.1f} | {_fmt(r.get('speedup_ffn_combine'), '.1f', '×')} |"
        )
    notes = [
        f"- {r['model']}: fused kernels not timed: {r['fused']}" for r in results if r["fused"]
    ]
    lines += ([""] + notes if notes else []) + [
        "",
        "Above: each sample evaluates independent calls, which MLX's CUDA graphs may overlap "
        "(throughput). Below: a dependent chain (residual stream through FFN + combine, layer after "
        "layer, as in decode), i.e. latency per MoE layer including launch overheads:",
        "",
        "| model | fused layer µs | GB/s | gather_qmm layer µs | GB/s | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        us, g = r["us"], r["gbs"]
        lines.append(
            f"| {r['model']} | {_fmt(us.get('fused_layer_chained'), '.1f')} "
            f"| {_gbs(g.get('fused_layer_chained'))} "
            f"| {us['gather_qmm_layer_chained']:.1f} | {_gbs(g['gather_qmm_layer_chained'])} "
            f"| {_fmt(r.get('speedup_chained'), '.1f', '×')} |"
        )
    timed = [r for r in results if "best_config" in r]
    if timed:
        lines += [
            "",
            "Best launch shapes (lpr = lanes per weight row, nw = warps per threadgroup, "
            "rpw = row iterations per threadgroup, nr = rows loaded together):",
            "",
        ]
    for r in timed:
        lines.append(
            f"- {r['model']}: glu `{json.dumps(r['best_config']['glu'])}`, "
            f"down `{json.dumps(r['best_config']['down'])}`"
        )
    if any("mxfp4" in r for r in results):
        lines += mxfp4_markdown(meta, results)
    if any(len(r.get("glu_sweep", [])) > 1 for r in results):
        lines += [
            "",
            "## Launch-shape sweep (each kernel alone)",
            "",
            "| model | kernel | config | µs | GB/s |",
            "|---|---|---|---|---|",
        ]
        for r in timed:
            for kind in ("glu", "down"):
                for row in r[f"{kind}_sweep"]:
                    lines.append(
                        f"| {r['model']} | {kind} | `{json.dumps(row['config'])}`"
                        f"{' (default)' if row['default'] else ''} | {row['us']:.1f} | {_gbs(row['gbs'])} |"
                    )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        nargs="*",
        default=None,
        choices=list(MODELS),
        help="default: every model (gpt-oss-120b alone under --smoke)",
    )
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--pool-mb", type=float, default=700.0, help="pool size per model (>> L2)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sweep", action="store_true", help="time several launch shapes per kernel")
    p.add_argument(
        "--sweep-models",
        nargs="*",
        default=["qwen3.5-397b-a17b"],
        help="models that get the full launch-shape grid under --sweep (others: a few)",
    )
    p.add_argument("--out", type=Path, default=None, help="directory for the .md and .json results")
    p.add_argument("--tag", default=None, help="GPU tag for the file names (e.g. h100)")
    p.add_argument(
        "--ncu-region",
        action="store_true",
        help="only run each path inside a cuProfilerStart/Stop region (run under ncu)",
    )
    p.add_argument("--ncu-calls", type=int, default=10)
    p.add_argument(
        "--configs",
        type=Path,
        default=None,
        help="JSON results of an earlier run: use its best launch shapes (--ncu-region)",
    )
    p.add_argument("--parse-ncu", type=Path, default=None, help="summarize an ncu CSV and exit")
    p.add_argument(
        "--mxfp4",
        action="store_true",
        help="also time mxfp4 experts (gpt-oss's format) through gather_qmm on each shape, "
        "against the affine paths of the same run: the case for a fused mxfp4 kernel",
    )
    p.add_argument("--copy-mb", type=float, default=1024.0, help="size of the device-copy probe")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds, CPU included: --mxfp4 --reps 2 --batch 2 --pool-mb 8 --copy-mb 64",
    )
    args = p.parse_args(argv)
    if args.parse_ncu:
        print(parse_ncu(args.parse_ncu, args.ncu_calls))
        return
    if args.smoke:
        args.mxfp4, args.reps, args.batch, args.pool_mb, args.copy_mb = True, 2, 2, 8.0, 64.0
    if args.models is None:
        args.models = ["gpt-oss-120b"] if args.smoke else list(MODELS)

    if mx.default_device() == mx.cpu:
        dialect = None  # custom kernels run on the GPU device only
    elif mx.metal.is_available():
        dialect = "metal"
    elif mx.cuda.is_available():
        dialect = "cuda"
    else:
        dialect = None
    t_start = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if dialect is None:
        if args.ncu_region:
            sys.exit("--ncu-region needs MLX with a Metal or CUDA GPU backend")
        log(f"note: {NO_GPU}; timing the gather_qmm paths only")
    if args.ncu_region:
        configs = {}
        if args.configs:
            configs = {
                r["model"]: r["best_config"]
                for r in json.loads(args.configs.read_text())["results"]
            }
        for m in args.models:
            ncu_region(m, args, dialect, configs)
        return
    copy_gbs = copy_bandwidth(args.copy_mb)
    meta = dict(
        gpu=gpu_name() if dialect else f"CPU ({platform.machine()})",
        dialect=dialect or "none (CPU)",
        mlx=mx.__version__,
        date=dt.date.today().isoformat(),
        bits=args.bits,
        group_size=args.group_size,
        reps=args.reps,
        batch=args.batch,
        pool_mb=args.pool_mb,
        copy_gbs=copy_gbs,
    )
    log(
        f"{meta['gpu']}  mlx {mx.__version__}  dialect {meta['dialect']}  copy {_gbs(copy_gbs)} GB/s"
    )
    results = [run_model(m, args, dialect, log) for m in args.models]
    md = markdown(meta, results)
    log(f"(total {time.time() - t_start:.0f} s)\n")
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = args.tag or meta["gpu"].lower().replace(" ", "-")
        stem = f"{meta['date']}-{tag}-kernels"
        (args.out / f"{stem}.md").write_text(md)
        (args.out / f"{stem}.json").write_text(
            json.dumps(dict(meta=meta, results=results), indent=1)
        )


if __name__ == "__main__":
    main()
