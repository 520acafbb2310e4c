"""Prefill benchmark: time to the first token of a long prompt, stock mlx-lm against moeflux-mlx
at small cache budgets, with the bytes the prefill read and what reading them alone costs.

    python benchmarks/prefill.py PATH                           # plain or converted checkpoint
    python benchmarks/prefill.py --size small --prompt-tokens 512 --budgets 0.25 --repeats 3
    python benchmarks/prefill.py --arch qwen3_moe --size full --layers 8 --convert --io pread

Every model is loaded at once and prefills in turn, ``--repeats`` rounds (medians: VMs are noisy).
Warm runs read the expert files once first; ``--cold`` drops them from the page cache before every
moeflux prefill. Per configuration: seconds to the first token (the prompt's forward pass and its
evaluation, as ``mlx_lm.generate_step`` does it, until the token is in hand) and to the device idle
(adding the next token's step, which ``generate_step`` queues first), each with its ratio to stock;
the bytes read, the pure read time of those very reads (replayed through the store alone, same I/O
mode and page-cache state, right after the prefill), and the overhead beyond the reads: moeflux -
stock - read time; the step (each model's own prefill step, or ``--prefill-step``; stock runs
at the same step) and the passes the prompt took. Against the bound: the bytes moved at the
slower of a copy rate measured in the same run (``lib.copy_rate``) and, cold, the disk's, the
share of that bound reached, stock beside it. Where the time goes: the wall time to idle split
by each layer's counters (read wait, copy to the device, device waits, Python) and the rest;
per layer in the markdown file, and printed with ``--per-layer``. A first token unlike stock's
is MISMATCH, exit 1. ``--prefill-whole-layer 4,0`` runs the machine setting's values side by side
(``Tuning.prefill_whole_layer``; 0: one host sync per layer and call, the path before whole-layer
reads, which always read the next layer ahead); ``--threads 8,16`` with that many read threads;
``--warm-read-threads 4,0`` with small reads from the page cache on 4 threads or on all (both
``Tuning`` fields too); ``--pin-experts on,off`` with the steps after the prompt copying their
misses on the GPU out of the page-locked expert files or the miss server reading them. With
``--routing-trace`` each round replays another window of the trace (every configuration the same
one), so no round finds the previous round's last experts waiting in the slots. Writes
``DATE-MACHINE-prefill.{md,json}`` to ``--out`` (never overwriting).
"""

import argparse
import datetime
import gc
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

import moeflux_mlx  # noqa: E402
from benchmarks.lib.cli import (  # noqa: E402
    add_model_args,
    benchmark_model,
    budget_list,
    io_list,
    replayed_routing,
)
from benchmarks.lib.copy_rate import bound, copy_rate, disk_rate  # noqa: E402
from benchmarks.lib.trace_routing import load_trace, rewind_routing  # noqa: E402
from moeflux_mlx.commands.common import UsageError, positive_int  # noqa: E402
from moeflux_mlx.errors import MoefluxError  # noqa: E402
from moeflux_mlx.format.checkpoint import expert_layout  # noqa: E402
from moeflux_mlx.io.bandwidth import drop_page_cache, expert_files  # noqa: E402
from moeflux_mlx.measure import free_stem, machine_name, machine_tag  # noqa: E402
from moeflux_mlx.options import (  # noqa: E402
    DEFAULT_PREFILL_WHOLE_LAYER,
    DEFAULT_THREADS,
    DEFAULT_WARM_READ_THREADS,
)
from tests.support.tuning import tuned  # noqa: E402


def _floats(text: str):
    return [float(v) for v in text.split(",")]


def build_model(args) -> tuple:
    """(path moeflux streams from, path stock mlx-lm loads): as ``moeflux-mlx bench`` does."""
    model, stock = benchmark_model(args)
    return model, stock or model


def warm_page_cache(files) -> None:
    """Read every expert file once, so that warm runs find their bytes in the page cache."""
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def first_token(model, prompt, step: int) -> tuple:
    """(seconds until the first token is in hand, seconds until the device is idle, the token,
    the forward passes the prompt took).

    ``generate_step`` prefills all but the prompt's last token ``step`` tokens a pass, then
    passes the last one and queues the next token's step before it waits for the first token,
    so the first time is the prefill as a caller sees it and the second adds that queued step,
    the first of the decode."""
    chunks = []  # generate_step reports 0, each prefill pass's end, then the whole prompt
    mx.synchronize()
    t0 = time.perf_counter()
    tok, _ = next(
        generate_step(
            prompt,
            model,
            max_tokens=1,
            prefill_step_size=step,
            prompt_progress_callback=lambda done, total: chunks.append(done),
        )
    )
    tok = int(tok)
    t_token = time.perf_counter() - t0
    mx.synchronize()
    passes = sum(1 for done in chunks if 0 < done < len(prompt)) + 1  # and the last position
    return t_token, time.perf_counter() - t0, tok, passes


# where a prefill's time goes, from each layer's counters (``moeflux_mlx.counters.LayerStats``):
# (key, column) of the times, then of the counts
TIMES = (
    ("io_s", "read wait s"),
    ("upload_s", "copy to device s"),
    ("sync_s", "device waits s"),
    ("compute_s", "python s"),
)
COUNTS = (("bytes_read", "MB read"), ("experts_read", "experts read"), ("calls", "calls"))


def breakdown(rounds: list, walls: list) -> dict:
    """Per layer and in total, the median over rounds of each counter of ``TIMES`` and
    ``COUNTS``, and in total the wall time to idle and the rest of it (the wall time less the
    counted times: attention and the rest of the model, the device's work nobody waited for in
    a sync, the last logits); per round the counters are that round's (reset before it).

    Args:
        rounds: each round's ``model.moeflux.stats_dict()``.
        walls: each round's seconds to idle.
    """
    keys = [k for k, _ in TIMES + COUNTS]
    layers = sorted({int(i) for d in rounds for i in d["layers"]})

    def of(d: dict, i: int) -> dict:
        return d["layers"].get(i) or d["layers"].get(str(i)) or {}

    per_layer = {
        i: {k: statistics.median(of(d, i).get(k, 0) for d in rounds) for k in keys} for i in layers
    }
    total = {k: statistics.median(d["total"][k] for d in rounds) for k in keys}
    total["wall_s"] = statistics.median(walls)
    total["rest_s"] = statistics.median(
        w - sum(d["total"][k] for k, _ in TIMES) for d, w in zip(rounds, walls)
    )
    return {"layers": per_layer, "total": total}


def _cell(key: str, v: float) -> str:
    if key == "bytes_read":
        return f"{v / 1e6:.1f}"
    return f"{v:.0f}" if key in dict(COUNTS) else f"{v:.3f}"


def format_bound(result: dict) -> str:
    """Each moeflux configuration against moving its bytes alone (``lib.copy_rate.bound``)."""
    head = (
        "| config | MB moved | bound s | bound's rate | s to idle | share of bound "
        "| GB/s reached | stock s to idle |"
    )
    lines = [head, "|" + " --- |" * 8]
    for r in result["rows"]:
        if "bound_s" not in r:
            continue
        gbs = r["bytes_moved"] / r["seconds"] / 1e9
        lines.append(
            f"| {r['config']} | {r['bytes_moved'] / 1e6:.1f} | {r['bound_s']:.4g} "
            f"| {r['bound_rate']}, {r['bound_rate_bytes_s'] / 1e9:.2f} GB/s | {r['seconds']:.3f} "
            f"| {100 * r['bound_share']:.3g}% | {gbs:.3g} | {r['stock_seconds']:.3f} |"
        )
    return "\n".join(lines)


BOUND_NOTE = (
    "bound s: the bytes the prefill moved (to idle) at the slower of the copy rate measured in "
    "this run (a buffer of one layer's bytes: on CUDA the copy engine out of page-locked "
    "memory, 128 experts' rows, as a whole-layer read's are moved; on another GPU an mx.array "
    "made from numpy; on the CPU a memcpy) and, for cold runs, the disk's cold read rate; bound's rate names which. "
    "share of bound: bound s / s to idle (1: the prefill took only as long as moving its bytes); "
    "stock, which moves none, beside it."
)


BREAKDOWN_NOTE = (
    "Each layer's counters over the prefill to idle (reset before it; the first decode step "
    "included), medians over rounds: read wait (io_s: waiting for expert reads, what reading "
    "ahead did not hide), copy to device (upload_s), device waits (sync_s: host syncs, the "
    "device's computation queued before them included), python (compute_s: building the "
    "expert computation), and the rest of the wall time to idle (attention and the rest of "
    "the model, device work no sync waited for, the logits); MB and experts read, expert "
    "calls."
)


def format_breakdown(result: dict) -> str:
    """Each moeflux configuration's totals: the wall time to idle split by the counters."""
    head = (
        "| config | s to idle | "
        + " | ".join(c for _, c in TIMES)
        + " | rest s | "
        + " | ".join(c for _, c in COUNTS)
        + " |"
    )
    lines = [head, "|" + " --- |" * (3 + len(TIMES) + len(COUNTS))]
    for r in result["rows"]:
        if "breakdown" not in r:
            continue
        t = r["breakdown"]["total"]
        wall = t["wall_s"] or 1e-9
        times = [f"{t[k]:.3f} ({t[k] / wall:.0%})" for k, _ in TIMES + (("rest_s", ""),)]
        counts = [_cell(k, t[k]) for k, _ in COUNTS]
        lines.append(f"| {r['config']} | {t['wall_s']:.3f} | " + " | ".join(times + counts) + " |")
    return "\n".join(lines)


def format_layers(row: dict) -> str:
    """One configuration's per-layer rows, then its totals (the rest is the whole prefill's)."""
    head = "| layer | " + " | ".join(c for _, c in TIMES) + " | rest s | "
    head += " | ".join(c for _, c in COUNTS) + " |"
    lines = [head, "|" + " --- |" * (2 + len(TIMES) + len(COUNTS))]
    b = row["breakdown"]
    for i, lay in b["layers"].items():
        cells = [_cell(k, lay[k]) for k, _ in TIMES] + ["-"]
        cells += [_cell(k, lay[k]) for k, _ in COUNTS]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    t = b["total"]
    cells = [_cell(k, t[k]) for k, _ in TIMES] + [f"{t['rest_s']:.3f}"]
    cells += [_cell(k, t[k]) for k, _ in COUNTS]
    lines.append("| **total** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stock_name(steps) -> dict:
    """{step: stock's configuration name}: stock runs once per step the moeflux configurations
    take, so that each compares with stock at its own step (a step changes the arithmetic)."""
    steps = sorted(set(steps))
    if len(steps) == 1:
        return {steps[0]: "stock mlx-lm"}
    return {s: f"stock mlx-lm step={s}" for s in steps}


class ReadLog:
    """Records every ``store.read`` of a model (layer, experts), to replay them alone."""

    def __init__(self, store):
        self.store, self.calls = store, []
        self._read = store.read
        store.read = self.read  # the caches read through the store itself

    def read(self, layer, experts, out=None, whole=False):
        self.calls.append((layer, experts.copy(), whole))
        return self._read(layer, experts, out, whole)

    def replay_s(self, files, cold: bool) -> float:
        """Seconds the recorded reads take through the store alone (same mode, page cache)."""
        if cold:
            drop_page_cache(files)
        t0 = time.perf_counter()
        for layer, experts, whole in self.calls:
            self._read(layer, experts, whole=whole)
        return time.perf_counter() - t0


# the per-model switches, as (argument, name when on, name when off); each runs side by side only
# where layers are read whole
SWITCHES = (("pin_experts", "pinned", "unpinned"),)


def _variants(args):
    """(prefill_whole_layer, {switch: on}, threads, warm read threads) of each moeflux
    configuration: the whole-layer switches varied only where layers are read whole."""
    names = [arg for arg, *_ in SWITCHES]
    for whole in args.prefill_whole_layer:
        values = [getattr(args, a) if whole else getattr(args, a)[:1] for a in names]
        for ons in itertools.product(*values):
            for threads, warm in itertools.product(args.threads, args.warm_read_threads):
                yield whole, dict(zip(names, ons)), threads, warm


def _variant_name(args, io_mode, frac, whole, switches, threads, warm) -> str:
    name = f"moeflux {io_mode} {frac:.0%} whole={whole:g}"
    for arg, on, off in SWITCHES:
        if whole and len(getattr(args, arg)) > 1:
            value = switches[arg]
            name += f" {arg} auto" if value is None else f" {on if value else off}"
    if len(args.threads) > 1:
        name += f" {threads} threads"
    if len(args.warm_read_threads) > 1:
        name += f" warm reads on {warm}" if warm else " warm reads on all"
    return name


def _switches(text: str):
    return [{"on": True, "off": False, "auto": None}[v.strip().lower()] for v in text.split(",")]


def _ints(text: str):
    return [int(v) for v in text.split(",")]


def _round_shifts(args) -> list:
    """Where in a replayed trace each round (the warm-up first) starts, past the replay's start.

    Every model replays the same window in a round, so configurations compare on the same
    routing; rounds take windows spread over the trace, so no round's steps after the prompt
    find the experts the round before left in the slots.
    """
    rounds = args.repeats + 1
    if args.routing_trace is None:
        return [0] * rounds
    trace = load_trace(args.routing_trace)
    span = trace.routed.shape[0]
    window = args.prompt_tokens + 2  # the prompt, then the first generated token's step
    if span < window:
        raise UsageError(
            f"{args.routing_trace}: {span} replayable positions, fewer than the prompt's "
            f"{args.prompt_tokens} and the two steps after it"
        )
    step = (span - window) // max(1, rounds - 1)
    return [r * step for r in range(rounds)]


def run(args) -> dict:
    prepare = replayed_routing(args.routing_trace)
    path, stock_path = build_model(args)
    layout = expert_layout(path)
    total = layout.total_expert_bytes
    files = expert_files(path)
    mx.random.seed(args.seed)
    prompt = mx.random.randint(0, 256, (args.prompt_tokens,)).astype(mx.uint32)
    stock_model = mlx_lm.load(str(stock_path))[0]
    models, steps, logs, ios = {}, {}, {}, {}
    for io in args.io:
        for frac in args.budgets:
            for whole, switches, threads, warm in _variants(args):
                budget = "all" if frac >= 1 else int(frac * total)
                options = tuned(
                    prefill_whole_layer=whole, threads=threads, warm_read_threads=warm, **switches
                )
                m, _ = moeflux_mlx.load(
                    path,
                    options=options,
                    expert_io=io,
                    cache_budget=budget,
                    backend=args.bench_backend,
                )
                name = _variant_name(
                    args, m.moeflux.store.io_mode, frac, whole, switches, threads, warm
                )
                models[name] = m
                steps[name] = args.prefill_step or m.moeflux.prefill_step_size
                ios[name] = io
                logs[name] = ReadLog(m.moeflux.store)
    stocks = stock_name(steps.values())
    stock_of = {name: stocks[step] for name, step in steps.items()}
    for step, name in stocks.items():
        models, steps[name] = {name: stock_model, **models}, step
    shifts = _round_shifts(args)
    if prepare is not None:
        for m in models.values():
            prepare(m)
    warm_page_cache(files)
    for name, m in models.items():
        rewind_routing(m, shifts[0])
        first_token(m, prompt, steps[name])  # warm-up: kernels of these shapes, allocator
    rows = {
        k: {
            "s": [],
            "token_s": [],
            "tokens": [],
            "passes": [],
            "read_s": [],
            "bytes": [],
            "stats": [],
        }
        for k in models
    }
    for shift in shifts[1:]:
        for name, m in models.items():
            rewind_routing(m, shift)
            rt = getattr(m, "moeflux", None)
            if rt is not None:
                rt.reset_stats()
                logs[name].calls.clear()
                if args.cold:
                    drop_page_cache(files)
            token_s, s, tok, passes = first_token(m, prompt, steps[name])
            r = rows[name]
            r["s"].append(s)
            r["token_s"].append(token_s)
            r["tokens"].append(tok)
            r["passes"].append(passes)
            if rt is not None:
                d = rt.stats_dict()  # counts what the miss server read for the steps after
                r["bytes"].append(d["total"]["bytes_read"])
                r["stats"].append(d)
                r["read_s"].append(logs[name].replay_s(files, args.cold))
    # the bound, measured here after the rounds: a layer's bytes copied as a prefill's reach
    # the device, and the disk's cold rate where the runs were cold
    layer_bytes = max(lay.layer_bytes for lay in layout.layers.values())
    copy = copy_rate(layer_bytes)
    disks = {io: disk_rate(path, io, args.threads[0]) for io in args.io} if args.cold else {}
    out_rows, stock_raw = [], {name: rows.pop(name) for name in stocks.values()}
    for step, name in stocks.items():
        stock = stock_raw[name]
        out_rows.append(
            {
                "config": name,
                "prefill_step": step,
                "passes": stock["passes"][-1],
                "seconds": statistics.median(stock["s"]),
                "all_seconds": stock["s"],
                "token_seconds": statistics.median(stock["token_s"]),
                "all_token_seconds": stock["token_s"],
                "tokens": stock["tokens"],
            }
        )
    for name, r in rows.items():
        stock = stock_raw[stock_of[name]]
        overhead = [m - s - rd for m, s, rd in zip(r["s"], stock["s"], r["read_s"])]
        moved = statistics.median(r["bytes"])
        bound_s, rate, rate_name = bound(moved, copy, disks.get(ios[name]))
        seconds = statistics.median(r["s"])
        out_rows.append(
            {
                "config": name,
                "stock": stock_of[name],
                "prefill_step": steps[name],
                "passes": r["passes"][-1],
                "seconds": statistics.median(r["s"]),
                "all_seconds": r["s"],
                "ratio_to_stock": statistics.median(m / s for m, s in zip(r["s"], stock["s"])),
                "token_seconds": statistics.median(r["token_s"]),
                "all_token_seconds": r["token_s"],
                "token_ratio_to_stock": statistics.median(
                    m / s for m, s in zip(r["token_s"], stock["token_s"])
                ),
                "mb_read": statistics.median(r["bytes"]) / 1e6,
                "read_s": statistics.median(r["read_s"]),
                "overhead_beyond_reads_s": statistics.median(overhead),
                "missed": statistics.median(x["total"]["experts_missed"] for x in r["stats"]),
                "breakdown": breakdown(r["stats"], r["s"]),
                "bytes_moved": moved,
                "bound_s": bound_s,
                "bound_rate_bytes_s": rate,
                "bound_rate": rate_name,
                "bound_share": bound_s / seconds,
                "stock_seconds": statistics.median(stock["s"]),
                "tokens": r["tokens"],
                "token_as_stock": r["tokens"] == stock["tokens"],
            }
        )
    for m in models.values():
        if hasattr(m, "moeflux"):
            m.moeflux.close()
    del models
    gc.collect()
    return {
        "model": str(path),
        "stock_model": str(stock_path),
        "machine": machine_name(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "prompt_tokens": args.prompt_tokens,
        "cpu_count": os.cpu_count(),
        "cold": args.cold,
        "repeats": args.repeats,
        "routing_trace": str(args.routing_trace) if args.routing_trace else None,
        "copy_rate": {"bytes_s": copy[0], "what": copy[1], "buffer_bytes": layer_bytes},
        "disk_rates_cold": disks,
        "rows": out_rows,
    }


def format_table(result: dict) -> str:
    head = (
        "| config | step | passes | s to first token | x stock | s to idle | x stock | MB read "
        "| read s | overhead beyond reads s | missed | token = stock |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in result["rows"]:
        start = f"| {r['config']} | {r['prefill_step']} | {r['passes']} "
        if "ratio_to_stock" not in r:
            lines.append(
                start + f"| {r['token_seconds']:.3f} | 1.00 | {r['seconds']:.3f} | 1.00 |"
                " - | - | - | - | - |"
            )
            continue
        lines.append(
            start + f"| {r['token_seconds']:.3f} | {r['token_ratio_to_stock']:.2f} "
            f"| {r['seconds']:.3f} | {r['ratio_to_stock']:.2f} "
            f"| {r['mb_read']:.0f} | {r['read_s']:.3f} | {r['overhead_beyond_reads_s']:+.2f} "
            f"| {r['missed']:.0f} | {'yes' if r['token_as_stock'] else 'MISMATCH'} |"
        )
    return "\n".join(lines)


def write(result: dict, out: Path, stem: str) -> list:
    out.mkdir(parents=True, exist_ok=True)
    stem = free_stem(out, stem)
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(result, indent=1))
    md.write_text(
        "\n".join(
            [
                f"# Prefill benchmark: {Path(result['model']).name}",
                "",
                f"Machine: {result['machine']}; MLX {result['mlx']} ({result['device']}); "
                f"{result['prompt_tokens']}-token prompt, "
                f"{'cold' if result['cold'] else 'warm'} page cache, "
                f"median of {result['repeats']} alternating rounds.",
                "s to first token: until the token is in hand, the prefill as a caller sees "
                "it; s to idle: until the device is idle, which adds the next token's step that "
                "mlx-lm queues before it waits for the first (the first decode step). "
                "step: prompt tokens per forward pass (stock runs at each configuration's); "
                "passes: the prompt's forward passes, its last position's included. "
                "read s: the same reads (both steps') through the store alone; overhead beyond "
                "reads: moeflux - stock - read s, to idle (per round, median). missed: experts "
                "not resident when a call asked (a whole-layer call counts every expert its rows "
                "routed; the rest are the steps after the prompt). With a routing trace, each "
                "round replays another window of it, every configuration the same.",
                "",
                format_table(result),
                "",
                "## Against moving the bytes alone",
                "",
                BOUND_NOTE,
                "",
                format_bound(result),
                "",
                "## Where the time goes",
                "",
                BREAKDOWN_NOTE,
                "",
                format_breakdown(result),
                "",
            ]
            + [
                f"### {r['config']}\n\n{format_layers(r)}\n"
                for r in result["rows"]
                if "breakdown" in r
            ]
        )
    )
    return [js, md]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(p)
    p.add_argument("--convert", action="store_true", help="stream from a converted copy")
    p.add_argument("--routing-trace", type=Path, default=None, metavar="TRACE")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--budgets", type=budget_list, default=[0.25])
    p.add_argument(
        "--prefill-step",
        type=positive_int,
        default=None,
        help="prompt tokens per forward pass, stock's too (default: each moeflux model's own, "
        "model.moeflux.prefill_step_size; stock runs at each such step)",
    )
    p.add_argument(
        "--io", type=io_list, default=["auto"], help="auto,mmap,pread,direct (default: auto)"
    )
    p.add_argument(
        "--prefill-whole-layer",
        type=_floats,
        default=[DEFAULT_PREFILL_WHOLE_LAYER],
        help="values of Tuning.prefill_whole_layer to run side by side, e.g. 4,0 (0: the synced "
        f"path; default {DEFAULT_PREFILL_WHOLE_LAYER:g}, the package's)",
    )
    p.add_argument(
        "--pin-experts",
        type=_switches,
        default=[None],
        help="on,off,auto: the GPU copies a prefill's layers and the later steps' misses out of "
        "the page-locked expert files, or they are read (the load option pin_experts; default "
        "auto, as the option's)",
    )
    p.add_argument(
        "--threads",
        type=_ints,
        default=[DEFAULT_THREADS],
        help=f"read threads (Tuning.threads), e.g. 8,16 (default: the package's, "
        f"{DEFAULT_THREADS} here)",
    )
    p.add_argument(
        "--warm-read-threads",
        type=_ints,
        default=[DEFAULT_WARM_READ_THREADS],
        help="threads of a read of a few experts that the page cache holds, e.g. 4,0 (0: every "
        f"thread; Tuning.warm_read_threads, default {DEFAULT_WARM_READ_THREADS})",
    )
    p.add_argument("--bench-backend", default=None, help="expert backend (default: auto)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="print each configuration's per-layer breakdown (the markdown file has it always)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--machine", default=None, help="machine label for the results file name")
    p.add_argument("--out", type=Path, default=Path("moeflux-bench-results"))
    args = p.parse_args(argv)
    try:
        result = run(args)
    except (MoefluxError, OSError) as e:
        print(f"prefill.py: error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    print()
    print(format_bound(result))
    print()
    print(format_breakdown(result))
    if args.per_layer:
        for r in result["rows"]:
            if "breakdown" in r:
                print(f"\n{r['config']}:\n{format_layers(r)}")
    print()
    machine = args.machine or machine_tag(result["machine"])
    for f in write(result, args.out, f"{datetime.date.today()}-{machine}-prefill"):
        print("wrote", f)
    tokens = {r["config"]: r["tokens"] for r in result["rows"]}
    mismatched = [r for r in result["rows"] if r.get("token_as_stock") is False]
    for r in mismatched:
        print(
            f"MISMATCH: {r['config']}: first tokens {r['tokens']}, {r['stock']}'s "
            f"{tokens[r['stock']]}",
            file=sys.stderr,
        )
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
