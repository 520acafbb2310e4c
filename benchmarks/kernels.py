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

    python benchmarks/kernels.py --sweep --out benchmarks/results --tag h100
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.switch_layers import SwiGLU

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moeflux_mlx.cache.pool import ExpertPool  # noqa: E402
from moeflux_mlx.compute import kernels as K  # noqa: E402
from moeflux_mlx.compute.ops import OpsBackend  # noqa: E402
from moeflux_mlx.format.layout import Quantization  # noqa: E402

MODELS = {  # hidden, intermediate, routed experts per token
    "qwen3-30b-a3b": (2048, 768, 8),
    "qwen3.5-397b-a17b": (4096, 1024, 10),
    "deepseek-v3": (7168, 2048, 8),
}


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


def make_pool(n, hid, inter, bits, gs, dtype):
    """Random packed weights (every bit pattern is a valid quantized weight), random scales."""
    arrays = {}
    for proj, (o, i) in {
        "gate_proj": (inter, hid),
        "up_proj": (inter, hid),
        "down_proj": (hid, inter),
    }.items():
        arrays[f"{proj}.weight"] = random_words((n, o, i * bits // 32))
        arrays[f"{proj}.scales"] = (mx.random.uniform(0.5, 1.5, (n, o, i // gs)) * 0.01).astype(
            dtype
        )
        arrays[f"{proj}.biases"] = (mx.random.normal((n, o, i // gs)) * 0.01).astype(dtype)
        mx.eval(arrays)
    return ExpertPool(arrays, Quantization(bits, gs))


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


def copy_bandwidth():
    a = random_words((256 * 1024 * 1024,))  # 1 GiB
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


def run_model(name, args, dialect, log):
    hid, inter, topk = MODELS[name]
    bits, gs, dtype = args.bits, args.group_size, mx.bfloat16
    probe = make_pool(1, hid, inter, bits, gs, dtype)
    per_expert = expert_bytes(probe)
    n_slots = max(4 * topk, math.ceil(args.pool_mb * 1e6 / per_expert))
    pool = make_pool(n_slots, hid, inter, bits, gs, dtype)
    a = pool.arrays
    n_sets = 64
    slot_sets = [
        mx.random.permutation(n_slots)[:topk].reshape(1, topk).astype(mx.int32)
        for _ in range(n_sets)
    ]
    xs = [mx.random.normal((1, hid)).astype(dtype) for _ in range(n_sets)]
    hs = [mx.random.normal((1, topk, inter)).astype(dtype) for _ in range(n_sets)]
    rs = [mx.random.normal((1, hid)).astype(dtype) for _ in range(n_sets)]
    ws = [mx.softmax(mx.random.normal((1, topk)), axis=-1).astype(dtype) for _ in range(n_sets)]
    ys = [mx.random.normal((1, topk, hid)).astype(dtype) for _ in range(n_sets)]
    mx.eval(slot_sets, xs, hs, rs, ws, ys)
    glu_bytes = topk * expert_bytes(pool, ("gate_proj", "up_proj"))
    down_bytes = topk * expert_bytes(pool, ("down_proj",))
    ffn_bytes = glu_bytes + down_bytes
    q = dict(bits=bits, group_size=gs, dialect=dialect)
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
    )
    log(
        f"== {name}: H={hid} I={inter} K={topk}, pool {n_slots} experts "
        f"({res['pool_mb']} MB), {ffn_bytes / 1e6:.1f} MB read per token"
    )

    def t(make):
        return timeit(make, n_sets, args.reps, args.batch)

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
                make = lambda i, c=cfg: K.glu_matvec(xs[i], a, slot_sets[i], config=c, **q)  # noqa: E731
            else:
                make = lambda i, c=cfg: K.down_matvec(hs[i], a, slot_sets[i], config=c, **q)  # noqa: E731
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
                f"   {kind:5s} {json.dumps(cfg):48s} {med * 1e6:8.1f} us  {nbytes / med / 1e9:7.0f} GB/s"
                + ("  (default)" if cfg == default else "")
            )
        rows.sort(key=lambda r: r["us"])
        res[f"{kind}_sweep"] = rows
        best[kind] = rows[0]["config"]
    res["best_config"] = best

    # --- paths (best launch shapes), same pool, same experts
    ops = OpsBackend()
    act = SwiGLU()
    gcfg, dcfg = best["glu"], best["down"]

    def fused_ffn(i):
        h = K.glu_matvec(xs[i], a, slot_sets[i], config=gcfg, **q)
        return K.down_matvec(h, a, slot_sets[i], config=dcfg, **q)

    def fused_all(i):
        return K.combine(rs[i], fused_ffn(i), ws[i], dialect=dialect)

    def ops_ffn(i):
        return ops(xs[i], slot_sets[i], pool, act)

    def ops_all(i):
        y = ops_ffn(i)
        return rs[i] + (y * ws[i][..., None]).sum(axis=-2).astype(y.dtype)

    timings = {
        "glu": t(lambda i: K.glu_matvec(xs[i], a, slot_sets[i], config=gcfg, **q)),
        "down": t(lambda i: K.down_matvec(hs[i], a, slot_sets[i], config=dcfg, **q)),
        "combine": t(lambda i: K.combine(rs[i], ys[i], ws[i], dialect=dialect)),
        "fused_ffn": t(fused_ffn),
        "fused_ffn_combine": t(fused_all),
        "gather_qmm_ffn": t(ops_ffn),
        "gather_qmm_ffn_combine": t(ops_all),
    }

    # dependent chains: residual stream through FFN + combine, layer after layer
    def fused_layer(i, x):
        return K.combine(x, fused_ffn_x(i, x), ws[i], dialect=dialect)

    def fused_ffn_x(i, x):
        h = K.glu_matvec(x, a, slot_sets[i], config=gcfg, **q)
        return K.down_matvec(h, a, slot_sets[i], config=dcfg, **q)

    def ops_layer(i, x):
        y = ops(x, slot_sets[i], pool, act)
        return x + (y * ws[i][..., None]).sum(axis=-2).astype(y.dtype)

    timings["fused_layer_chained"] = time_chain(fused_layer, xs[0], n_sets, args.reps, args.batch)
    timings["gather_qmm_layer_chained"] = time_chain(
        ops_layer, xs[0], n_sets, args.reps, args.batch
    )
    # the two paths must agree (same weights, same experts)
    err = mx.abs(
        fused_ffn(0).astype(mx.float32) - ops_ffn(0).reshape(1, topk, hid).astype(mx.float32)
    )
    ref = mx.abs(ops_ffn(0).astype(mx.float32))
    res["fused_vs_gather_qmm_max_abs"] = float(err.max().item())
    res["gather_qmm_max_abs"] = float(ref.max().item())
    res["us"] = {k: v[0] * 1e6 for k, v in timings.items()}
    res["min_us"] = {k: v[1] * 1e6 for k, v in timings.items()}
    res["gbs"] = {
        "glu": glu_bytes / timings["glu"][0] / 1e9,
        "down": down_bytes / timings["down"][0] / 1e9,
        "fused_ffn": ffn_bytes / timings["fused_ffn"][0] / 1e9,
        "fused_ffn_combine": ffn_bytes / timings["fused_ffn_combine"][0] / 1e9,
        "gather_qmm_ffn": ffn_bytes / timings["gather_qmm_ffn"][0] / 1e9,
        "gather_qmm_ffn_combine": ffn_bytes / timings["gather_qmm_ffn_combine"][0] / 1e9,
    }
    res["gbs"]["fused_layer_chained"] = ffn_bytes / timings["fused_layer_chained"][0] / 1e9
    res["gbs"]["gather_qmm_layer_chained"] = (
        ffn_bytes / timings["gather_qmm_layer_chained"][0] / 1e9
    )
    res["speedup_chained"] = (
        timings["gather_qmm_layer_chained"][0] / timings["fused_layer_chained"][0]
    )
    res["speedup_ffn"] = timings["gather_qmm_ffn"][0] / timings["fused_ffn"][0]
    res["speedup_ffn_combine"] = (
        timings["gather_qmm_ffn_combine"][0] / timings["fused_ffn_combine"][0]
    )
    for k, (med, _) in timings.items():
        log(
            f"   {k:24s} {med * 1e6:8.1f} us"
            + (f"  {res['gbs'][k]:7.0f} GB/s" if k in res["gbs"] else "")
        )
    mx.clear_cache()
    return res


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


def markdown(meta, results):
    lines = [
        f"# Fused expert kernels vs gather_qmm — {meta['gpu']} ({meta['date']})",
        "",
        f"MLX {meta['mlx']}, dialect `{meta['dialect']}`, {meta['bits']}-bit group {meta['group_size']}, "
        f"bf16 activations, T=1 (decode). Medians of {meta['reps']} samples × {meta['batch']} calls; "
        f"weights rotate over a pool of ≥ {meta['pool_mb']} MB (L2 is 50 MB). "
        f"Device copy in the same run: {meta['copy_gbs']:.0f} GB/s (read + write).",
        "",
        "GB/s = bytes of expert weights + scales + biases read per call / time.",
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
            f"| {us['glu']:.1f} | {us['down']:.1f} | {us['combine']:.1f} | {us['fused_ffn']:.1f} "
            f"| {g['fused_ffn']:.0f} | {us['gather_qmm_ffn']:.1f} | {g['gather_qmm_ffn']:.0f} "
            f"| {r['speedup_ffn']:.1f}× | {us['fused_ffn_combine']:.1f} | {us['gather_qmm_ffn_combine']:.1f} "
            f"| {r['speedup_ffn_combine']:.1f}× |"
        )
    lines += [
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
            f"| {r['model']} | {us['fused_layer_chained']:.1f} | {g['fused_layer_chained']:.0f} "
            f"| {us['gather_qmm_layer_chained']:.1f} | {g['gather_qmm_layer_chained']:.0f} "
            f"| {r['speedup_chained']:.1f}× |"
        )
    lines += [
        "",
        "Best launch shapes (lpr = lanes per weight row, nw = warps per threadgroup, "
        "rpw = row iterations per threadgroup, nr = rows loaded together):",
        "",
    ]
    for r in results:
        lines.append(
            f"- {r['model']}: glu `{json.dumps(r['best_config']['glu'])}`, "
            f"down `{json.dumps(r['best_config']['down'])}`"
        )
    if any(len(r.get("glu_sweep", [])) > 1 for r in results):
        lines += [
            "",
            "## Launch-shape sweep (each kernel alone)",
            "",
            "| model | kernel | config | µs | GB/s |",
            "|---|---|---|---|---|",
        ]
        for r in results:
            for kind in ("glu", "down"):
                for row in r[f"{kind}_sweep"]:
                    lines.append(
                        f"| {r['model']} | {kind} | `{json.dumps(row['config'])}`"
                        f"{' (default)' if row['default'] else ''} | {row['us']:.1f} | {row['gbs']:.0f} |"
                    )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
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
    args = p.parse_args(argv)
    if args.parse_ncu:
        print(parse_ncu(args.parse_ncu, args.ncu_calls))
        return

    if mx.metal.is_available():
        dialect = "metal"
    elif mx.cuda.is_available():
        dialect = "cuda"
    else:
        sys.exit("benchmarks/kernels.py needs MLX with a Metal or CUDA GPU backend")
    t_start = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
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
    copy_gbs = copy_bandwidth()
    meta = dict(
        gpu=gpu_name(),
        dialect=dialect,
        mlx=mx.__version__,
        date=dt.date.today().isoformat(),
        bits=args.bits,
        group_size=args.group_size,
        reps=args.reps,
        batch=args.batch,
        pool_mb=args.pool_mb,
        copy_gbs=copy_gbs,
    )
    log(f"{meta['gpu']}  mlx {mx.__version__}  dialect {dialect}  copy {copy_gbs:.0f} GB/s")
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
