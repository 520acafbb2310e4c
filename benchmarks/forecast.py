"""Check ``moeflux-mlx doctor``'s decode forecast against measured decode.

The forecast (``moeflux_mlx.commands.doctor.forecast``) is built only from what doctor
measures or records: decode measured at two budgets (``calibrate_decode``: 90% of the experts
and 15% of that, raised so that each layer holds 1.5x its top-k), the line
``t = t_stream + missed bytes / miss rate`` through them, and the hit rate at each budget read
off the model's hit-rate curve (``moeflux_mlx.cache.curve``: its routing on a short text replayed
through the eviction policy; recorded here first, as doctor records it, unless one is recorded
already or ``--recalibrate``). This script then measures decode at three other budgets (25, 50
and 75%) with the page cache warm and prints and writes a forecast-versus-measured table. Goal:
within +-20%. ``--cold`` adds the same with cold reads (``pread``, the page cache dropped every
millisecond, the expert files not pinned: a model larger than RAM), calibrated cold too.

The measured decode continues the calibration text, so that it routes as the curve's tokens did.
A random-weight model routes no text as a trained one does; ``--routing-trace`` replays a
trained model's recorded routing in every router, both while the curve is recorded (always
anew then) and while decode is measured, so the forecast is checked on real reuse and skew.

    python benchmarks/forecast.py                    # qwen3_moe "medium", float32, built once
    python benchmarks/forecast.py --routing-trace benchmarks/results/traces/2026-11-25-trained-text.npz
    python benchmarks/forecast.py --model DIR --label h200
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moeflux_mlx.cache.curve import CurveError, find_curve  # noqa: E402
from moeflux_mlx.commands.doctor import (  # noqa: E402
    calibrate_decode,
    forecast,
    measure_decode,
    record_curve,
    top_k_of,
)
from moeflux_mlx.format.checkpoint import expert_layout, is_packed  # noqa: E402
from moeflux_mlx.format.convert import convert  # noqa: E402
from moeflux_mlx.io.bandwidth import read_bandwidth  # noqa: E402
from moeflux_mlx.model.calibrate import calibration_ids  # noqa: E402
from tests.support import synth  # noqa: E402

BUDGETS = (0.25, 0.5, 0.75)
GOAL = 20  # percent


def _model(args) -> Path:
    if args.model:
        return Path(args.model)
    root = Path(args.workdir)
    packed = root / f"{args.size}-{args.dtype}-packed"
    if not (packed / "config.json").is_file():
        src = synth.build_checkpoint(
            root / f"{args.size}-{args.dtype}", "qwen3_moe", args.size, seed=0, dtype=args.dtype
        )
        convert(src, packed, progress=False)
    return packed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a converted directory or checkpoint (default: a synth model)")
    p.add_argument("--size", default="medium", choices=("small", "medium"))
    p.add_argument("--dtype", default="float32", help="activation dtype of the synth model")
    p.add_argument("--workdir", default="/tmp/moeflux-forecast")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per measurement")
    p.add_argument(
        "--routing-trace",
        type=Path,
        default=None,
        metavar="TRACE",
        help="replay this routing trace (benchmarks/cache_policy.py's .npz) in the routers; the "
        "model must have its experts per layer and top-k (the medium model does: 64, top-8)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="also calibrate and measure with cold reads (page cache dropped, files not pinned)",
    )
    p.add_argument("--label", default="cpu2", help="machine label for the results file name")
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="record the hit-rate curve again even where one is recorded",
    )
    p.add_argument(
        "--out",
        default=None,
        help="markdown file (default: benchmarks/results/<date>-<label>-forecast.md)",
    )
    args = p.parse_args(argv)
    path = _model(args)
    layout = expert_layout(path)
    total, k = layout.total_expert_bytes, top_k_of(path)
    print(
        f"model {path}: {total / 1e6:.1f} MB of experts, top-{k}, {len(layout.layers)} MoE layers",
        flush=True,
    )

    cold_bw, warm_bw = read_bandwidth(path)
    print(
        f"read bandwidth: cold {cold_bw / 1e9:.2f} GB/s, warm {warm_bw / 1e9:.2f} GB/s", flush=True
    )
    prepare = None
    if args.routing_trace is not None:
        from benchmarks.lib.trace_routing import drive_routing, load_trace

        trace = load_trace(args.routing_trace)
        prepare = lambda model: drive_routing(model, trace, args.routing_trace)  # noqa: E731
    prompt = calibration_ids(path)
    routed = sum(k * lay.blob_size for lay in layout.layers.values())
    reads = [("warm", warm_bw, {})] + (
        [("cold", cold_bw, {"cold": True, "pin_experts": False})] if args.cold else []
    )
    calibrations = {}
    for name, bw, how in reads:
        cal = calibrate_decode(
            path, layout, k, total, bw, name, args.tokens, prompt=prompt, prepare=prepare,
            expert_io="pread", **how,
        )  # fmt: skip
        calibrations[name] = cal
        print(
            f"calibration ({name}): "
            + ", ".join(f"{1 / t:.2f} tok/s at {b / total:.0%}" for b, t, _ in cal.points)
            + f"; {1e3 * cal.timing.compute_s_per_token:.1f} ms/token + misses at "
            f"{cal.timing.bandwidth / 1e9:.2f} GB/s ({cal.timing.basis})",
            flush=True,
        )
    warm_timing = calibrations["warm"].timing

    try:
        fresh = args.recalibrate or prepare is not None  # a trace's curve is recorded each run
        curve = None if fresh else find_curve(path)
    except CurveError as e:
        print(f"{e}: recording it anew", flush=True)
        curve = None
    if curve is None or not curve.fits(layout, k) or "transition" not in curve.hit_rates:
        t0 = time.perf_counter()
        curve = record_curve(path, warm_timing, prepare=prepare, expert_io="pread")
        print(f"recorded the hit-rate curve in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"hit-rate curve {curve.path} ({curve.tokens} tokens)", flush=True)

    rows = []
    for name, _, how in reads:
        timing = calibrations[name].timing
        for f in BUDGETS:
            budget = int(f * total)
            fc = forecast(
                layout, k, budget, timing.bandwidth, timing.compute_s_per_token, curve,
                "transition",
            )  # fmt: skip
            s_tok, io_tok, st = measure_decode(
                path, budget, args.tokens, prompt=prompt, prepare=prepare, expert_io="pread", **how
            )
            t = st["total"]
            n = st["decode_tokens"]
            mb = t["bytes_read"] / max(n, 1) / 1e6
            hit = t["hit_rate"]
            measured = 1 / s_tok
            err = (fc.tok_s - measured) / measured
            rows.append(
                (
                    f"{f:.0%}", name, f"{fc.hit_rate:.0%}", f"{hit:.0%}" if hit is not None else "-",
                    f"{fc.miss_bytes_per_token / 1e6:.1f}", f"{mb:.1f}",
                    f"{1e3 * fc.io_s_per_token:.1f}", f"{1e3 * io_tok:.1f}",
                    f"{fc.tok_s:.2f}", f"{measured:.2f}", f"{100 * err:+.0f}%",
                )
            )  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)

    head = (
        "budget", "reads", "hit rate forecast", "hit rate measured", "MB/token forecast",
        "MB/token measured", "read ms/token forecast", "read+upload ms/token measured",
        "tok/s forecast", "tok/s measured", "error",
    )  # fmt: skip
    errors = [abs(float(r[-1].rstrip("%"))) for r in rows]
    routing = f"replayed from {args.routing_trace}" if prepare else "the model's own"
    within = sum(e <= GOAL for e in errors)
    lines = [
        f"# Decode forecast vs measured ({args.label}, {time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/forecast.py {' '.join(argv if argv is not None else sys.argv[1:])}`".replace(
            " `", "`"
        ),
        "",
        f"- machine: {platform.platform()}, {platform.machine()}; MLX {mx.__version__}, device {mx.default_device()}",
        f"- model: `{path}` ({'converted' if is_packed(path) else 'checkpoint'}): {total / 1e6:.1f} MB of experts, "
        f"{len(layout.layers)} MoE layers, top-{k}, {routed / 1e6:.1f} MB of experts routed per token",
        "- read bandwidth (up to 256 distinct whole experts, 8 threads): "
        f"cold {cold_bw / 1e9:.2f} GB/s, warm {warm_bw / 1e9:.2f} GB/s",
        *(
            f"- calibration ({name}): decode "
            + ", ".join(
                f"{1 / t:.2f} tok/s at {b / total:.0%} ({m / 1e6:.1f} MB missed a token)"
                for b, t, m in cal.points
            )
            + f"; the line: {1e3 * cal.timing.compute_s_per_token:.1f} ms/token + missed bytes at "
            f"{cal.timing.bandwidth / 1e9:.2f} GB/s ({cal.timing.basis}); backend {cal.backend}"
            for name, cal in calibrations.items()
        ),
        f"- {args.tokens} decode tokens per measurement, continuing the calibration text, after 4 warm-up tokens; "
        "`pread` reads; cold = page cache dropped every millisecond while decoding",
        f"- routing: {routing}",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" for _ in head) + " |",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        f"- hit rates forecast from the curve `{curve.path}` ({curve.tokens} tokens of routing "
        "on the built-in calibration text, replayed through the transition policy)",
        "",
        f"Within +-{GOAL}%: {within} of {len(rows)} (largest error {max(errors):.0f}%).",
        "",
    ]
    out = (
        Path(args.out)
        if args.out
        else Path(__file__).parent
        / "results"
        / (f"{time.strftime('%Y-%m-%d')}-{args.label}-forecast.md")
    )
    out.write_text("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
