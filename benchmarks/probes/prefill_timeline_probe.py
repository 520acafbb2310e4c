"""Where does a whole-layer prefill's time go, layer by layer? (MLX CUDA backend; runs anywhere)

Loads the model as ``benchmarks/prefill.py`` does (stock mlx-lm, and moeflux at one budget with
whole-layer reads), and times the prefill with every step of ``HostSyncCache.whole_lookup``
stamped on the host clock: the ``mx.async_eval`` that starts the previous layer's computation,
the wait for the layer's read (``take``), the wait for the device (``mx.eval`` of the previous
layer's output and this layer's copies), and, on the read thread, each layer's read. Runs the
copy kernel at several block counts (``cuda.layer_copy.LAYER_COPY_BLOCKS``; 0: MLX's own copy
kernel, which takes every SM) in alternating rounds with stock, and prints, per variant, the
median prefill and its split, then one round's timeline per layer.

    python benchmarks/probes/prefill_timeline_probe.py --arch qwen3_moe --size full --layers 8 \\
        --set num_experts=64 --convert --routing-trace TRACE --blocks 0,8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: prefill.py

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from prefill import build_model, first_token, warm_page_cache  # noqa: E402

import moeflux_mlx  # noqa: E402
from moeflux_mlx.benchmark.pagecache import expert_files  # noqa: E402
from moeflux_mlx.benchmark.trace_routing import drive_routing, load_trace  # noqa: E402
from moeflux_mlx.cache import synced, whole_layer  # noqa: E402
from moeflux_mlx.commands.bench import add_model_args  # noqa: E402
from moeflux_mlx.cuda import layer_copy  # noqa: E402
from moeflux_mlx.cuda.control_block import S_IO_NS  # noqa: E402
from moeflux_mlx.format.checkpoint import expert_layout  # noqa: E402

EVENTS: list = []  # (what, layer, start, end, thread name)
_LAYER = threading.local()


def _stamp(what, layer, t0):
    EVENTS.append((what, layer, t0, time.perf_counter(), threading.current_thread().name))


class _TimedMx:
    """``mlx.core`` for ``cache.synced``, with its ``eval`` and ``async_eval`` stamped;
    ``skip_async``: ``whole_lookup``'s ``async_eval`` does nothing (the ``eval`` that follows
    runs it all)."""

    skip_async = False

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *a):
        t0 = time.perf_counter()
        mx.eval(*a)
        _stamp("eval", getattr(_LAYER, "n", -1), t0)

    def async_eval(self, *a):
        t0 = time.perf_counter()
        if not (self.skip_async and getattr(_LAYER, "whole", False)):
            mx.async_eval(*a)
        _stamp("async_eval", getattr(_LAYER, "n", -1), t0)


def instrument() -> _TimedMx:
    synced.mx = timed = _TimedMx()
    lookup = synced.HostSyncCache.whole_lookup

    def whole_lookup(self, layer, indices, stats):
        _LAYER.n, _LAYER.whole = layer, True
        t0 = time.perf_counter()
        try:
            return lookup(self, layer, indices, stats)
        finally:
            _LAYER.whole = False
            _stamp("lookup", layer, t0)

    synced.HostSyncCache.whole_lookup = whole_lookup
    take = whole_layer.WholeLayerReads.take

    def timed_take(self, layer, stats):
        t0 = time.perf_counter()
        try:
            return take(self, layer, stats)
        finally:
            _stamp("take", layer, t0)

    whole_layer.WholeLayerReads.take = timed_take
    fill = whole_layer._fill

    def timed_fill(store, read, copies):
        t0 = time.perf_counter()
        try:
            return fill(store, read, copies)
        finally:
            _stamp("read", read.layer, t0)

    whole_layer._fill = timed_fill
    return timed


def split(events, t_start):
    """Sums per kind (ms) and the per-layer rows of one prefill's events."""
    sums = {}
    for what, _, a, b, _ in events:
        sums[what] = sums.get(what, 0.0) + (b - a) * 1e3
    rows = []
    for what, layer, a, b, thread in sorted(events, key=lambda e: e[2]):
        rows.append(
            f"{what:>10} L{layer:<2} {(a - t_start) * 1e3:8.2f} -> {(b - t_start) * 1e3:8.2f} ms "
            f"({(b - a) * 1e3:6.2f}) {thread}"
        )
    return sums, rows


def _server_read_s(rt) -> float:
    """Seconds the miss server has spent reading (the device-side table's misses; 0 without)."""
    control = getattr(rt.cache, "control", None)
    if control is None:
        return 0.0
    return sum(float(t.stats[S_IO_NS]) for t in control.layers.values()) / 1e9


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(p)
    p.add_argument("--convert", action="store_true")
    p.add_argument("--routing-trace", type=Path, default=None)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--io", default="pread")
    p.add_argument("--blocks", default="0,8,16,32", help="LAYER_COPY_BLOCKS values, 0: MLX's copy")
    p.add_argument(
        "--no-async",
        default="",
        help="LAYER_COPY_BLOCKS values also run without whole_lookup's async_eval, e.g. 16",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", default="8", help="read threads, e.g. 8,16: a model each")
    args = p.parse_args()
    path, stock_path = build_model(args)
    total = expert_layout(path).total_expert_bytes
    # a stock twin per moeflux model: a replayed trace advances with each model's own calls, so
    # each pair must prefill as often to route alike (one stock for two models did not)
    stocks = {t: mlx_lm.load(str(stock_path))[0] for t in (int(v) for v in args.threads.split(","))}
    models = {
        t: moeflux_mlx.load(
            path, expert_io=args.io, cache_budget=int(args.budget * total), threads=t
        )[0]
        for t in (int(v) for v in args.threads.split(","))
    }
    if args.routing_trace:
        trace = load_trace(args.routing_trace)
        for m in [*stocks.values(), *models.values()]:
            drive_routing(m, trace, args.routing_trace)
    timed = instrument()
    warm_page_cache(expert_files(path))
    mx.random.seed(0)
    prompt = mx.random.randint(0, 256, (args.prompt_tokens,)).astype(mx.uint32)
    print(
        f"device {mx.default_device()}, MLX {mx.__version__}, copy kernel available: "
        f"{layer_copy.copier() is not None}"
    )
    variants = [(t, int(b), False) for t in models for b in args.blocks.split(",")]
    variants += [(t, int(b), True) for t in models for b in args.no_async.split(",") if b]
    results = {}
    for t, b, _ in variants:
        layer_copy.LAYER_COPY_BLOCKS = b
        first_token(models[t], prompt)  # compiles this variant's kernel
        first_token(stocks[t], prompt)  # and keeps its twin's replayed trace in step
    for _ in range(args.repeats):
        for t, b, skip in variants:
            layer_copy.LAYER_COPY_BLOCKS, timed.skip_async = b, skip
            _, s_stock, tok_stock = first_token(stocks[t], prompt)
            rt = models[t].moeflux
            rt.reset_stats()
            served0 = _server_read_s(rt)
            EVENTS.clear()
            t0 = time.perf_counter()
            _, s, tok = first_token(models[t], prompt)
            d = rt.stats_dict()["total"]
            whole = sum(ly.num_experts for ly in rt.layout.layers.values())
            # beyond the whole layers: the last prompt token's misses, and the GPU's waits
            tail_io = (
                d["experts_missed"] - whole,
                d["gpu_waits"],
                d["gpu_wait_s"] * 1e3,
                (_server_read_s(rt) - served0) * 1e3,
            )
            name = f"{t} threads, {b} blocks{', no async_eval' if skip else ''}"
            events = list(EVENTS)
            last = max((e[3] for e in events if e[0] == "lookup" and e[1] >= 0), default=t0)
            tail = s - (last - t0)  # after the last whole-layer call: its layer, the last token
            results.setdefault(name, []).append(
                (s / s_stock, s, s_stock, tok == tok_stock, *split(events, t0), tail, tail_io)
            )
    print(
        "\n| read threads, copy blocks (0: MLX's kernel) | x stock | s | stock s | same token "
        "| ms: async_eval | take | eval | lookup | read (thread) | tail "
        "| last token: misses | GPU waits | their ms | server's reads, ms |"
    )
    print("|" + " --- |" * 15)
    for name, runs in results.items():
        runs.sort(key=lambda r: r[0])
        mid = runs[len(runs) // 2]
        sums = mid[4]
        print(
            f"| {name} | {statistics.median(r[0] for r in runs):.2f} | {mid[1]:.3f} "
            f"| {mid[2]:.3f} | {all(r[3] for r in runs)} | {sums.get('async_eval', 0):.1f} "
            f"| {sums.get('take', 0):.1f} | {sums.get('eval', 0):.1f} "
            f"| {sums.get('lookup', 0):.1f} | {sums.get('read', 0):.1f} | {mid[6] * 1e3:.1f} "
            f"| {mid[7][0]} | {mid[7][1]} | {mid[7][2]:.1f} | {mid[7][3]:.1f} |"
        )
    for name, runs in results.items():
        print(f"\n## timeline, {name} (the median round)")
        print("\n".join(runs[len(runs) // 2][5]))
    for m in models.values():
        m.moeflux.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
