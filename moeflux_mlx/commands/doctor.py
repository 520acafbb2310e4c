"""``moeflux-mlx doctor [MODEL]``: what to paste into a bug report, and what to choose a cache
budget by.

Prints the platform, MLX / mlx-lm versions, the device and the backend that will compute the
experts, what the machine decided rather than an option (read threads, the device-side table,
slot writes, whole-layer prefill), the kernels' self-check verdicts on this machine; RAM, and
on Metal the recommended working set and the wired limit. With a MODEL: the RAM gate's choice,
a recommended cache budget (one that fits the working set), a short measured read bandwidth of
the disk holding the experts (cold: page cache dropped first; warm: the same reads again), the
decode time per token measured at two budgets, and a forecast of decode tok/s at several
budgets:

    t(budget) = t_stream + (expert bytes a token misses at that budget) / miss rate

where a token misses, in each MoE layer, top-k x blob bytes x (1 - hit rate). ``t_stream`` (a
token's time on the streaming path with nothing missed) and the miss rate (what a missed byte
costs decode: its read, its copy and the device's wait for it) are the line through the two
measured decodes, each the time per token against the bytes it missed (``calibrate_decode``).
The hit rate is the model's measured hit-rate curve (``cache.curve``): doctor records the
model's routing on a short built-in text, replays it through the eviction policy at budgets of
0-100% of the experts, and records the curve (with the two terms above) beside the model, where
``cache_budget="auto"`` reads it. It prints the curve (and plots it, where matplotlib is
installed) and the budget auto would choose. Without a curve (``--no-bench``) a layer holding n of
its E experts is estimated to hit n / E (routing uniform over the experts).
``benchmarks/forecast.py`` checks the forecast against measured decode.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import psutil

from .. import __version__
from ..cache import wired
from ..cache.curve import HitCurve, Timing, auto_budget, tok_s
from ..cache.slots import slots_per_layer, smallest_budget
from ..compute import kernels as K
from ..compute import selfcheck
from ..compute.backend import backend_report, select_backend
from ..format.checkpoint import expert_layout, read_config
from ..format.layout import ModelLayout
from ..format.safetensors import index_directory
from ..io.bandwidth import read_bandwidth
from ..io.store import choose_expert_io
from ..model.calibrate import calibrate, calibration_ids
from ..model.load import load
from ..model.runtime import machine_choices
from ..model.source import resolve_model_path
from ..options import DEFAULT_RAM_FRACTION, LoadOptions, parse_budget
from .common import (
    MACHINE_HEADING,
    MACHINE_NOTE,
    add_load_args,
    command_parser,
    fmt_bytes,
    load_kwargs,
    main_for,
)

DESCRIPTION = (
    "what to paste into a bug report: platform, versions, device, kernel self-check, memory; "
    "with a MODEL, disk bandwidth, a recommended cache budget and a decode forecast"
)
DECODE_TOKENS = 16
FORECAST_FRACTIONS = (0.0, 0.25, 0.5, 1.0)
# doctor's two measured budgets: the recommended one, at most this share of the experts (the
# streaming path serves it: every expert resident would not show what the path costs) ...
CALIBRATION_TOP = 0.9
# ... and this fraction of it, where each layer still holds one and a half times its top-k
CALIBRATION_LOW = 0.15


# ---------------------------------------------------------------------------------------------
# the forecast


@dataclass
class Forecast:
    budget_bytes: int
    hit_rate: float  # estimated, over the experts a token routes
    miss_bytes_per_token: float
    io_s_per_token: float
    compute_s_per_token: float

    @property
    def s_per_token(self) -> float:
        return self.compute_s_per_token + self.io_s_per_token

    @property
    def tok_s(self) -> float:
        return 1.0 / self.s_per_token if self.s_per_token > 0 else float("inf")


def estimated_hit_rates(layout: ModelLayout, budget_bytes: int) -> Dict[int, float]:
    """Per MoE layer, the share of its experts the budget keeps resident (``slots_per_layer``):
    the hit rate of an LRU cache under routing uniform over the experts."""
    n = slots_per_layer(layout, budget_bytes)
    return {i: n[i] / lay.num_experts for i, lay in layout.layers.items()}


def forecast(
    layout: ModelLayout,
    top_k: int,
    budget_bytes: int,
    bandwidth: float,
    compute_s_per_token: float,
    curve: Optional[HitCurve] = None,
    policy: str = "transition",
) -> Forecast:
    """Decode time per token at ``budget_bytes``: ``compute_s_per_token`` (the streaming path
    with nothing missed) plus the bytes a token misses over ``bandwidth`` (what a missed byte
    costs decode), both fitted by ``fit_timing``. At every expert the all-resident path runs,
    which is faster than this says.

    Args:
        layout: the model's expert layout.
        top_k: experts a token routes.
        budget_bytes: the cache budget.
        bandwidth: bytes/s: the miss rate.
        compute_s_per_token: seconds per token with nothing missed.
        curve: the model's hit-rate curve (None: ``estimated_hit_rates``, n / E).
        policy: the eviction policy whose curve is read.

    Returns:
        The forecast.
    """
    routed = sum(top_k * lay.blob_size for lay in layout.layers.values())
    if curve is not None:
        share = budget_bytes / max(layout.total_expert_bytes, 1)
        miss = routed * (1 - curve.hit_rate(policy, share))
    else:
        hits = estimated_hit_rates(layout, budget_bytes)
        miss = sum(top_k * lay.blob_size * (1 - hits[i]) for i, lay in layout.layers.items())
    return Forecast(
        budget_bytes,
        1 - miss / routed if routed else 1.0,
        miss,
        miss / bandwidth if bandwidth > 0 else float("inf"),
        compute_s_per_token,
    )


@dataclass
class Calibration:
    """Decode measured at two budgets, and the forecast's terms fitted to them.

    Attributes:
        points: ``(budget bytes, seconds per token, missed bytes per token)``, the higher
            budget first.
        timing: ``t_stream`` (``compute_s_per_token``) and the miss rate (``bandwidth``).
        backend: what computed the experts.
    """

    points: List[Tuple[int, float, float]]
    timing: Timing
    backend: str


def calibration_budgets(layout: ModelLayout, top_k: int, budget: int) -> Tuple[int, int]:
    """doctor's two measured budgets, the higher first: ``budget`` (at most ``CALIBRATION_TOP``
    of the experts) and ``CALIBRATION_LOW`` of it, raised where a layer would hold fewer than
    one and a half times its top-k (``slots.smallest_budget``)."""
    hi = min(budget, int(CALIBRATION_TOP * layout.total_expert_bytes))
    least = smallest_budget(layout, math.ceil(1.5 * top_k))
    return hi, min(hi, max(int(CALIBRATION_LOW * hi), least))


# the lower budget's decode must be this much slower than the higher's for a line through them:
# a smaller rise is within a short decode's noise, and its slope would make misses look free
CALIBRATION_RISE = 0.05


def fit_timing(points: Sequence[Tuple[int, float, float]], bandwidth: float, basis: str) -> Timing:
    """The line ``t = t_stream + missed bytes / miss rate`` through two measured decodes
    ``(budget, seconds per token, missed bytes per token)``. Where they do not span a clear
    rise (one budget, fewer misses at the lower, or a rise under ``CALIBRATION_RISE``), the
    miss rate is ``bandwidth`` (``basis``: which reads it is) and the line goes through the
    first point."""
    (_, t_hi, m_hi), (_, t_lo, m_lo) = points[0], points[-1]
    if m_lo > m_hi and t_lo > (1 + CALIBRATION_RISE) * t_hi:
        rate = (m_lo - m_hi) / (t_lo - t_hi)
        basis = "misses measured in decode"
    else:
        rate = bandwidth
    return Timing(rate, max(0.0, t_hi - m_hi / rate if rate > 0 else t_hi), basis)


def calibrate_decode(
    path: Path,
    layout: ModelLayout,
    top_k: int,
    budget: int,
    bandwidth: float,
    basis: str,
    tokens: int = DECODE_TOKENS,
    **measure,
) -> Calibration:
    """Measure decode at ``calibration_budgets`` and fit the forecast's terms to it.

    Args:
        path: the model directory.
        layout: its expert layout.
        top_k: experts a token routes.
        budget: the higher budget asked for (the recommended one).
        bandwidth: the read bandwidth the fit falls back on.
        basis: which reads ``bandwidth`` is, for people.
        tokens: decode tokens timed at each budget.
        **measure: ``measure_decode``'s other arguments (prompt, prepare, cold, load options).

    Returns:
        The measurements and the fitted timing.
    """
    points, backend = [], "-"
    for b in dict.fromkeys(calibration_budgets(layout, top_k, budget)):
        s_tok, _, st = measure_decode(path, b, tokens, **measure)
        missed = st["total"]["bytes_read"] / max(st["decode_tokens"], 1)
        points.append((b, s_tok, missed))
        backend = st["backend"]
    return Calibration(points, fit_timing(points, bandwidth, basis), backend)


def top_k_of(path: Path) -> int:
    config = read_config(path)
    text = config.get("text_config", config)
    return int(text.get("num_experts_per_tok") or text.get("moe_topk") or text.get("top_k") or 1)


def dense_bytes(path: Path) -> int:
    """Bytes of the non-expert weights (from the safetensors headers; 0 if unknown)."""
    try:
        tensors = index_directory(path)
    except Exception:  # noqa: BLE001 - a bug report should still print the rest
        return 0
    layout = expert_layout(path)
    total = sum(r.nbytes for r in tensors.values())
    return max(0, total - (0 if (path / "packed_experts").is_dir() else layout.total_expert_bytes))


def measure_decode(
    path: Path,
    budget,
    tokens: int = DECODE_TOKENS,
    cold: bool = False,
    prompt: Optional[Sequence[int]] = None,
    prepare: Optional[Callable[[nn.Module], object]] = None,
    **options,
) -> Tuple[float, float, dict]:
    """Greedy decode of ``tokens`` tokens after a short warm-up. Reads are warm (the page cache
    keeps what the warm-up read) unless ``cold``: then the page cache is dropped every
    millisecond while decoding (``pread`` reads only: mapped pages cannot be dropped).

    Args:
        path: the model directory.
        budget: its cache budget.
        tokens: decode tokens timed.
        cold: drop the page cache while decoding.
        prompt: token ids decoded after (None: eight fixed ids).
        prepare: run on the loaded model first (the forecast benchmark replays a routing trace).
        **options: load options.

    Returns:
        ``(seconds per token, of which reading and uploading experts, stats_dict)``.
    """
    from mlx_lm.generate import generate_step

    from ..io.bandwidth import PageCacheDropper, expert_files

    model, _ = load(path, cache_budget=budget, **options)
    rt = model.moeflux
    try:
        if prepare is not None:
            prepare(model)
        ids = mx.array(list(prompt) if prompt is not None else [1, 2, 3, 4, 5, 6, 7, 8])

        def run(n):
            gen = generate_step(ids, model, max_tokens=n + 1)
            next(gen)  # prefill
            mx.synchronize()
            rt.reset_stats()
            count, t0 = 0, time.perf_counter()
            for _tok, _ in gen:
                count += 1
            mx.synchronize()
            return (time.perf_counter() - t0) / max(count, 1), count

        run(4)  # warm-up: kernels of these shapes, allocator, whole-layer fills
        dropping = (
            PageCacheDropper(expert_files(path))
            if cold and rt.store.io_mode != "mmap"
            else contextlib.nullcontext()
        )
        with dropping:
            per_token, n = run(tokens)
        t = rt.stats.total()
        st = rt.stats_dict()
        st["decode_tokens"] = n
        return per_token, (t.io_s + t.upload_s) / max(n, 1), st
    finally:
        rt.close()


def record_curve(
    path: Path, timing: Timing, prepare: Optional[Callable[[nn.Module], object]] = None, **options
) -> HitCurve:
    """Load the model at the default budget (routing does not depend on it), record its routing
    on the built-in text and record the curve with ``timing`` (``model.calibrate``).

    Args:
        path: the model directory.
        timing: the measured bandwidth and compute time, recorded with the curve.
        prepare: run on the loaded model first (the forecast benchmark replays a routing trace).
        **options: load options.

    Returns:
        The curve, with the file it was written to.

    Raises:
        OSError: the curve could be written neither beside the model nor in the user cache.
    """
    model, tokenizer = load(path, **options)
    try:
        if prepare is not None:
            prepare(model)
        return calibrate(model, tokenizer, path, timing=timing)
    finally:
        model.moeflux.close()


def plot_curve(curve: HitCurve, policy: str, out: Path) -> Optional[Path]:
    """The curve as a PNG at ``out``, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([100 * s for s in curve.shares], [100 * h for h in curve.hit_rates[policy]], "o-")
    ax.set_xlabel("cache budget (% of the experts)")
    ax.set_ylabel(f"hit rate (%), {policy}")
    ax.set_title(f"{out.parent.name}: {curve.tokens} tokens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def curve_rows(
    curve: HitCurve, policy: str, layout: ModelLayout, top_k: int
) -> List[Tuple[str, str]]:
    """The curve as rows (budget share -> hit rate -> forecast tok/s, every 10%) and what auto
    chooses from it (``cache.curve.auto_budget``, as a load does).

    Args:
        curve: the model's curve, with a timing.
        policy: the eviction policy whose curve is shown.
        layout: the model's expert layout.
        top_k: experts a token routes.

    Returns:
        ``(label, value)`` rows.
    """
    assert curve.timing is not None
    t = curve.timing
    routed = sum(top_k * lay.blob_size for lay in layout.layers.values())
    rows = [("hit-rate curve", f"{curve.path} ({curve.tokens} tokens, eviction {policy})")]
    for share in curve.shares[::2]:
        rows.append(
            (
                f"  at {share:.0%}",
                f"hit rate {curve.hit_rate(policy, share):.0%}, forecast "
                f"{tok_s(curve, policy, share, routed, t):.1f} tok/s",
            )
        )
    auto = auto_budget(layout, policy, curve)
    rows.append(("cache budget auto", f"{fmt_bytes(auto.bytes)}: {auto.why}"))
    png = plot_curve(curve, policy, curve.path.with_suffix(".png")) if curve.path else None
    rows.append(("curve plot", str(png) if png else "install matplotlib for a plot"))
    return rows


def disk_bandwidth(path: Path, reads: int = 256, threads: int = 8) -> Tuple[float, float]:
    """``(cold, warm)`` bytes/s of the store's reads of distinct whole experts
    (``io.bandwidth.read_bandwidth``). Where the page cache cannot be dropped per file
    (macOS has no ``posix_fadvise``), the cold pass reads with caching off (``F_NOCACHE``)."""
    if hasattr(os, "posix_fadvise"):
        return read_bandwidth(path, reads, threads)
    import fcntl

    def caching(fds: List[int], cold: bool) -> None:
        for fd in fds:
            try:
                fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), int(cold))
            except OSError:  # not macOS: the "cold" pass may be warm
                pass

    return read_bandwidth(path, reads, threads, before_pass=caching)


# ---------------------------------------------------------------------------------------------
# the report


def _versions() -> List[Tuple[str, str]]:
    import mlx_lm

    return [
        (
            "platform",
            f"{platform.platform()} ({platform.machine()}), Python {platform.python_version()}",
        ),
        ("moeflux-mlx", __version__),
        ("mlx", selfcheck.MLX_VERSION),
        ("mlx-lm", getattr(mlx_lm, "__version__", "?")),
    ]


def _device_rows(given: dict) -> List[Tuple[str, str]]:
    rows = [("default device", str(mx.default_device()))]
    metal, cuda = mx.metal.is_available(), mx.cuda.is_available()
    rows.append(
        (
            "GPU backends",
            ", ".join(n for n, ok in (("metal", metal), ("cuda", cuda)) if ok)
            or "none (CPU build)",
        )
    )
    desc = selfcheck.device_description()
    if desc:
        rows.append(("device name", desc))
    options = LoadOptions.resolve(**given)
    try:
        backend = backend_report(select_backend(options.backend))
    except Exception as e:  # noqa: BLE001 - a bug report prints what it can
        backend = f"unavailable ({type(e).__name__}: {e})"
    rows.append(("backend", f"{backend} (requested: {options.backend})"))
    return rows


def machine_rows(given: dict) -> List[Tuple[str, str]]:
    """What the machine decides rather than a load option (``options.Tuning``), each choice and
    why: a heading row, then one indented row each (``model.runtime.machine_choices``)."""
    choices = machine_choices(LoadOptions.resolve(**given).tuning)
    return [(MACHINE_HEADING, MACHINE_NOTE)] + [(f"  {what}", why) for what, why in choices]


def _selfcheck_rows() -> List[Tuple[str, str]]:
    rows = []
    for dialect in K.DIALECTS:
        path = selfcheck.cache_file(dialect, K.source_digest(dialect))
        check = selfcheck.SelfCheck(dialect, K.source_digest(dialect))
        verdicts = check._load()
        if not verdicts:
            if K.dialect_available(dialect):
                rows.append(
                    (f"self-check ({dialect})", f"no variant checked yet on this machine ({path})")
                )
            continue
        failed = {k: v for k, v in verdicts.items() if not v.get("ok")}
        rows.append(
            (
                f"self-check ({dialect})",
                f"{len(verdicts) - len(failed)} of {len(verdicts)} variants passed ({path})",
            )
        )
        for label, v in failed.items():
            rows.append(("  failed", f"{label}: {v.get('error', '')[:300]}"))
    if not rows:
        rows.append(
            ("self-check", "nothing to check: no Metal or CUDA kernels run here (plain MLX ops)")
        )
    return rows


def _memory_rows() -> List[Tuple[str, str]]:
    ram = psutil.virtual_memory()
    rows = [("RAM", f"{fmt_bytes(ram.total)} total, {fmt_bytes(ram.available)} available")]
    dev = wired.MetalMemory()
    if dev.available():
        ws = dev.working_set()
        rows.append(("recommended working set", fmt_bytes(ws) if ws else "?"))
        limit = dev.wired_limit()
        rows.append(
            (
                "wired limit",
                "0 (nothing wired until mlx-lm generates)" if not limit else fmt_bytes(limit),
            )
        )
    else:
        rows.append(("wired memory", "n/a (Metal only)"))
    return rows


def recommended_budget(total_experts: int, dense: int) -> Tuple[int, str]:
    """The default budget (every expert if they fit in 0.4 x RAM, else 0.4 x RAM), fitted into
    the recommended working set on Metal (``cache.wired.fit_budget``)."""
    budget = parse_budget(None, total_experts)
    why = (
        "every expert"
        if budget >= total_experts
        else f"{DEFAULT_RAM_FRACTION} x RAM (the experts do not fit in it)"
    )
    dev = wired.MetalMemory()
    fitted, note = wired.fit_budget(
        budget, wired.staging_bytes_estimate(None), dev.working_set(), dense
    )
    if note:
        why += f"; {note}"
    return fitted, why


def _model_rows(path: Path, given: dict, bench: bool) -> List[Tuple[str, str]]:
    layout = expert_layout(path)
    total = layout.total_expert_bytes
    k = top_k_of(path)
    dense = dense_bytes(path)
    per_token = sum(k * lay.blob_size for lay in layout.layers.values())
    options = LoadOptions.resolve(**given)
    mode, gate_why = choose_expert_io(total, options.expert_io)
    rows = [
        ("model", str(path)),
        (
            "experts",
            f"{fmt_bytes(total)} in {len(layout.layers)} MoE layers; dense weights {fmt_bytes(dense)}",
        ),
        ("expert bytes per token", f"{fmt_bytes(per_token)} (top-{k} of each MoE layer)"),
        (
            "RAM gate",
            f"{mode} ({gate_why})",
        ),
    ]
    budget, why = recommended_budget(total, dense)
    rows.append(
        (
            "recommended cache budget",
            f"{fmt_bytes(budget)} ({100 * budget / max(total, 1):.0f}% of the experts: {why})",
        )
    )
    if not bench:
        return rows
    t0 = time.perf_counter()
    cold, warm = disk_bandwidth(path)
    rows.append(
        (
            "read bandwidth",
            f"cold {cold / 1e9:.2f} GB/s, warm (page cache) {warm / 1e9:.2f} GB/s ({time.perf_counter() - t0:.1f} s)",
        )
    )
    # the page cache dropped first where it can be (partial pages and files that cannot be
    # read uncached go through it); macOS: F_NOCACHE reads, nothing to drop
    keep = None if hasattr(os, "posix_fadvise") else (lambda fds, cold: None)
    uncached = read_bandwidth(path, io_mode="direct", before_pass=keep, warm=False)[0]
    rows.append(
        (
            "uncached reads",
            f"cold {uncached / 1e9:.2f} GB/s with expert_io=direct (bypasses the page cache: "
            "it pays for experts several times RAM, whose reads the page cache seldom serves)",
        )
    )
    fits_page_cache = total + budget < psutil.virtual_memory().available
    bw = warm if fits_page_cache else cold
    basis = (
        "the experts fit in the page cache beside the budget"
        if fits_page_cache
        else "the experts exceed the free RAM"
    )
    cal = calibrate_decode(
        path,
        layout,
        k,
        budget,
        bw,
        "warm" if fits_page_cache else "cold",
        prompt=calibration_ids(path),  # routes as the curve's text
        **{k2: v for k2, v in given.items() if k2 != "cache_budget"},
    )
    timing = cal.timing
    measured = ", ".join(
        f"{1 / t:.1f} tok/s at {fmt_bytes(b)} ({fmt_bytes(m)} missed a token)"
        for b, t, m in cal.points
    )
    rows.append(("decode, measured", f"{measured}; backend {cal.backend}"))
    rows.append(
        (
            "forecast basis",
            f"{1e3 * timing.compute_s_per_token:.1f} ms/token + missed bytes at "
            f"{timing.bandwidth / 1e9:.2f} GB/s ({timing.basis}"
            + ("" if timing.basis == "misses measured in decode" else f": {basis}")
            + ")",
        )
    )
    policy = options.eviction
    t0 = time.perf_counter()
    curve: Optional[HitCurve] = None
    try:
        curve = record_curve(
            path, timing, **{k2: v for k2, v in given.items() if k2 != "cache_budget"}
        )
    except OSError as e:  # neither beside the model nor in the user cache: forecast with n / E
        rows.append(("hit-rate curve", f"not recorded ({e}); the forecast assumes n / E"))
    else:
        rows.append(
            (
                "calibration",
                f"{curve.tokens} tokens routed and replayed ({time.perf_counter() - t0:.1f} s)",
            )
        )
        rows += curve_rows(curve, policy, layout, k)
    fractions = sorted({*FORECAST_FRACTIONS, min(1.0, budget / max(total, 1))})
    for f in fractions:
        fc = forecast(
            layout, k, int(f * total), timing.bandwidth, timing.compute_s_per_token, curve, policy
        )
        rows.append(
            (
                f"  forecast at {f:.0%}",
                f"{fc.tok_s:.1f} tok/s (hit rate {'' if curve else '~'}{fc.hit_rate:.0%}"
                f"{'' if curve else ', n / E'}, {fmt_bytes(fc.miss_bytes_per_token)} read per token)",
            )
        )
    return rows


def check_model_kernels(path: Path, given: dict) -> None:
    """Run the kernels' self-check for the model's layer shapes (one token per call, the
    activation dtype of the experts' scales), where kernels run here: its verdicts then show
    in the report."""
    from mlx_lm.models.switch_layers import SwiGLU

    from ..cache.pool import SlotPool

    backend = select_backend(LoadOptions.resolve(**given).backend)
    if not isinstance(backend, K.KernelBackend) or not backend.available:
        return
    layout = expert_layout(path)
    k = top_k_of(path)
    seen = set()
    for lay in layout.layers.values():
        key = tuple(sorted((c.name, c.shape, c.dtype) for c in lay.components))
        if key in seen:
            continue
        seen.add(key)
        if lay.quantization is None:
            continue
        pool = SlotPool(lay, max(k, 2)).pool
        if not pool.is_glu:
            continue
        dtype = pool.arrays["gate_proj.scales"].dtype
        x = mx.zeros(
            (1, 1, pool.arrays["gate_proj.weight"].shape[-1] * 32 // lay.quantization.bits), dtype
        )
        slots = mx.arange(k, dtype=mx.uint32).reshape(1, 1, k) % max(k, 2)
        mx.eval(backend(x, slots, pool, SwiGLU()))


def describe(model: Optional[Path], given: dict, bench: bool = True) -> List[Tuple[str, str]]:
    if model is not None:
        try:
            check_model_kernels(model, given)
        except Exception as e:  # noqa: BLE001 - the report goes on; the error is in it
            print(f"self-check of the model's kernels could not run: {type(e).__name__}: {e}")
    rows = _versions() + _device_rows(given) + machine_rows(given)
    rows += _selfcheck_rows() + _memory_rows()
    if model is not None:
        rows += _model_rows(model, given, bench)
    else:
        rows.append(
            ("model", "none given: pass a MODEL for the disk, the budget and a decode forecast")
        )
    return rows


def run(args: argparse.Namespace) -> int:
    path = resolve_model_path(args.model_path) if args.model_path else None
    rows = describe(path, load_kwargs(args), bench=not args.no_bench)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", flush=True)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_path",
        metavar="MODEL",
        nargs="?",
        default=None,
        help="converted directory or mlx-lm checkpoint (optional)",
    )
    p.add_argument(
        "--no-bench",
        action="store_true",
        help="skip the read-bandwidth and decode measurements, the calibration (the hit-rate "
        "curve) and the forecast",
    )
    add_load_args(p)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("doctor", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
