"""Decode benchmark: stock mlx-lm and moeflux-mlx side by side, in one process and one run.

For each configuration (stock when the model fits; moeflux at several cache budgets and both
I/O modes) it times prefill and greedy decode, and reads the streaming counters: experts and
bytes read per token, hit rate, time per token in sync / I/O / upload. It also measures the cold
read bandwidth of the disk holding the experts and the decode rate that bandwidth allows for the
bytes actually missed per token (the I/O bound). Results: a table on stdout, JSON, markdown and,
when matplotlib is installed, a PNG of tok/s against cache budget.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import platform
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx
import psutil
from mlx_lm.generate import generate_step

from .checkpoint import expert_layout, is_packed, packed_file, packed_layout, scan_checkpoint
from .errors import DeviceWaitError

log = logging.getLogger(__name__)


@dataclass
class Run:
    name: str
    io_mode: str = "-"
    budget: str = "-"  # fraction of the experts held in the cache
    lookup: str = "-"  # decode slot lookup: "device" (GPU table, host only on misses), "host" (sync)
    cold: bool = False
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    decode_tokens: int = 0
    decode_tps: float = 0.0
    ratio_to_stock: Optional[float] = None
    experts_read_per_token: float = 0.0
    mb_read_per_token: float = 0.0
    hit_rate: Optional[float] = None
    prefetch_issued_per_token: float = 0.0  # experts read ahead on a prediction
    prefetch_hits_per_token: float = 0.0  # misses a read-ahead had already served
    sync_ms_per_token: float = 0.0  # waiting for router indices: includes device compute before them
    io_ms_per_token: float = 0.0
    upload_ms_per_token: float = 0.0
    gpu_waits_per_token: float = 0.0  # device-side table: GPU waits for the miss server
    gpu_wait_ms_per_token: float = 0.0  # their time, the server's reads included
    other_ms_per_token: float = 0.0
    io_bound_tps: Optional[float] = None
    fraction_of_io_bound: Optional[float] = None
    peak_memory_gb: float = 0.0
    tokens: List[int] = field(default_factory=list, repr=False)


def expert_files(path: Path) -> List[Path]:
    if is_packed(path):
        return [packed_file(path, i) for i in packed_layout(path).layers]
    ckpt = scan_checkpoint(path)
    return sorted({r.file for comps in ckpt.ranges.values() for r in comps.values()})


def drop_page_cache(files: Sequence[Path]) -> None:
    """Evict the files' pages from the OS page cache (clean pages; no root needed on Linux).
    Dirty pages cannot be dropped: a file just written (a model converted a moment ago) is
    flushed first."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# The dropper's loop, in a process of its own: a thread of the benchmark's process needs the GIL
# every period, so how often it ran depended on what the decoding thread was doing (a decode
# that held the GIL kept its reads warm), and each wake-up took the GIL from the decode being
# timed. It sleeps in select() on stdin, which the benchmark closes to stop it (or dies).
_DROPPER = """
import os, select, sys
period = float(sys.argv[1])
fds = [os.open(f, os.O_RDONLY) for f in sys.argv[2:]]
drops = 0
while not select.select([sys.stdin], [], [], period)[0]:
    for fd in fds:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    drops += 1
print(drops, flush=True)
"""


class PageCacheDropper:
    """Drops the files' pages from the page cache every ``period_s``, in a process of its own,
    for as long as it runs: reads that follow are cold, as if the experts were many times RAM.

    Nothing is excluded from the timed region: the drops run beside the decode, on a core of
    their own, sharing nothing with it but the kernel's page cache. Mapped pages cannot be
    dropped this way (mmap runs are cold only at their start). ``drops``: how many rounds of
    drops it made, known once it has stopped."""

    def __init__(self, files: Sequence[Path], period_s: float = 1e-3):
        self.files, self.period_s = list(files), period_s
        self.drops = 0
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self):
        drop_page_cache(self.files)
        self._proc = subprocess.Popen([sys.executable, "-c", _DROPPER, str(self.period_s),
                                       *map(str, self.files)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        proc, self._proc = self._proc, None
        try:
            out, _ = proc.communicate(timeout=10)  # closes its stdin: the signal to stop
        except subprocess.TimeoutExpired:
            proc.kill()  # never left behind dropping pages
            proc.wait()
            raise
        if proc.returncode:
            raise RuntimeError(f"the page-cache dropper failed (exit code {proc.returncode})")
        self.drops = int(out.split()[-1])


def read_bandwidth(path: Path, reads: int = 256, threads: int = 8, seed: int = 0):
    """Bytes/s of random expert-sized reads: (cold, after dropping the page cache; warm, the
    same reads again from the page cache)."""
    files = expert_files(path)
    blob = next(iter(expert_layout(path).layers.values())).blob_size
    drop_page_cache(files)
    rng = random.Random(seed)
    jobs = []
    for _ in range(reads):
        f = rng.choice(files)
        size = f.stat().st_size
        jobs.append((f, rng.randrange(0, max(1, size - blob)) // 4096 * 4096))
    fds = {f: os.open(f, os.O_RDONLY) for f in files}

    def one(job):
        buf = bytearray(blob)
        return os.preadv(fds[job[0]], [buf], job[1])

    try:
        rates = []
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(2):
                t = time.perf_counter()
                total = sum(pool.map(one, jobs))
                rates.append(total / (time.perf_counter() - t))
        return tuple(rates)
    finally:
        for fd in fds.values():
            os.close(fd)


def _time_generation(model, prompt: mx.array, decode_tokens: int, on_first=None):
    """Greedy decode; returns (prompt_tps, decode_tps, tokens, decode seconds). ``on_first`` runs
    after the first token (end of prefill), before decode timing starts."""
    mx.synchronize()
    t0 = time.perf_counter()
    gen = generate_step(prompt, model, max_tokens=decode_tokens + 1)
    tok, _ = next(gen)
    tokens = [int(tok)]
    t1 = time.perf_counter()
    if on_first:
        on_first()
    t2 = time.perf_counter()
    for tok, _ in gen:
        tokens.append(int(tok))
    mx.synchronize()
    decode_s = time.perf_counter() - t2
    return prompt.size / (t1 - t0), (len(tokens) - 1) / decode_s, tokens, decode_s


def _run_stock(path, prompt, decode_tokens) -> Run:
    import mlx_lm

    model, _ = mlx_lm.load(str(path))
    _time_generation(model, prompt, 4)  # warm-up: kernels of these shapes, allocator
    mx.reset_peak_memory()
    ptps, dtps, tokens, _ = _time_generation(model, prompt, decode_tokens)
    run = Run("stock mlx-lm", prompt_tokens=prompt.size, prompt_tps=ptps,
              decode_tokens=len(tokens) - 1, decode_tps=dtps,
              peak_memory_gb=mx.get_peak_memory() / 1e9, tokens=tokens)
    del model
    gc.collect()
    mx.clear_cache()
    return run


def _run_moeflux(path, prompt, decode_tokens, io_mode, budget_fraction, cold, bandwidth,
                 backend=None, prefetch=False, device_table=None) -> Run:
    import moeflux_mlx

    total = expert_layout(path).total_expert_bytes
    budget = "all" if budget_fraction >= 1 else int(budget_fraction * total)
    model, _ = moeflux_mlx.load(path, expert_io=io_mode, cache_budget=budget, backend=backend,
                                prefetch=prefetch, device_table=device_table)
    rt = model.moeflux
    try:
        _time_generation(model, prompt, 4)  # warm-up: kernels of these shapes, allocator, fills
        files = expert_files(path)
        if cold:
            drop_page_cache(files)
        # pread + cold: keep dropping the page cache while decoding, as if the experts were many
        # times RAM (mapped pages cannot be dropped: mmap runs are cold only at their start)
        dropping = (PageCacheDropper(files) if cold and rt.store.io_mode == "pread"
                    else contextlib.nullcontext())
        mx.reset_peak_memory()
        rt.reset_stats()
        with dropping:
            ptps, dtps, tokens, decode_s = _time_generation(model, prompt, decode_tokens,
                                                            on_first=rt.reset_stats)
        rt.stats_dict()  # counts what the miss server read, if any
        t = rt.stats.total()
        n = max(len(tokens) - 1, 1)
        table = getattr(rt.cache, "control", None) is not None
        lookup = "-" if t.calls == t.unsynced_calls and not table else ("device" if table else "host")
        run = Run(f"moeflux {rt.backend.name}" + (" +prefetch" if prefetch else ""), io_mode=rt.store.io_mode,
                  budget=f"{budget_fraction:.0%}", lookup=lookup, cold=cold, prompt_tokens=prompt.size,
                  prompt_tps=ptps, decode_tokens=n, decode_tps=dtps,
                  experts_read_per_token=t.experts_read / n, mb_read_per_token=t.bytes_read / n / 1e6,
                  hit_rate=rt.stats.hit_rate if t.experts_routed else None,
                  prefetch_issued_per_token=t.prefetch_issued / n,
                  prefetch_hits_per_token=t.prefetch_hits / n,
                  sync_ms_per_token=1e3 * t.sync_s / n, io_ms_per_token=1e3 * t.io_s / n,
                  upload_ms_per_token=1e3 * t.upload_s / n,
                  gpu_waits_per_token=t.gpu_waits / n, gpu_wait_ms_per_token=1e3 * t.gpu_wait_s / n,
                  # the device table's reads happen inside the GPU's waits
                  other_ms_per_token=1e3 * (decode_s - t.sync_s - max(t.io_s, t.gpu_wait_s)
                                            - t.upload_s) / n,
                  peak_memory_gb=mx.get_peak_memory() / 1e9, tokens=tokens)
        if t.bytes_read and bandwidth:
            run.io_bound_tps = bandwidth / (t.bytes_read / n)
            run.fraction_of_io_bound = dtps / run.io_bound_tps
        return run
    finally:
        rt.close()
        del model
        gc.collect()
        mx.clear_cache()


def _moe_layers(path: Path) -> int:
    return len(expert_layout(path).layers)


def sync_overhead(runs: List[Run], moe_layers: int, lookup: str = "host",
                  budget: str = "99%") -> Optional[float]:
    """ms per MoE layer that a layer's slot lookup costs: the run at ``budget`` with ``lookup``
    (``host``: one sync per layer, ``device``: the GPU table; 99%: nearly all hits, the few
    misses' reads included; 100% with the device table: every expert resident and still
    looked up, the lookup alone) against the 100% run that looks nothing up (slot == expert
    id), same I/O mode."""
    by = {(r.io_mode, r.budget, r.lookup): r for r in runs if not r.name.endswith("+prefetch")}
    deltas = [1e3 * (1 / by[(io, budget, lookup)].decode_tps - 1 / r.decode_tps) / moe_layers
              for (io, b, lk), r in by.items() if b == "100%" and lk == "-"
              and (io, budget, lookup) in by]
    return min(deltas) if deltas else None


class SkippedExperts:
    """A stand-in backend that reads no expert weight and launches no kernel: it hands ``x`` back
    as every expert's output (``[..., K, H]``, a broadcast). Decode with it is the fastest any
    expert kernel could make the model: the rest of the model alone. Tokens are meaningless."""

    name = "experts skipped"

    def __call__(self, x: mx.array, slots: mx.array, pool, activation) -> mx.array:
        shape = (*x.shape[:-1], slots.shape[-1], x.shape[-1])
        return mx.broadcast_to(mx.expand_dims(x, -2), shape)


CEILING = "moeflux experts skipped (ceiling)"


def _paired_resident(path, stock_path, prompt, decode_tokens, io_mode, backends, n,
                     table: bool = False) -> dict:
    """Stock mlx-lm and moeflux with every expert resident (one model per backend), all loaded
    at once and decoding in turn, ``n`` rounds: decode tok/s of each, and per backend the median
    of its per-round ratio to stock (slow drifts of the machine hit both sides of a round).
    ``table``: the last backend once more, every expert looked up through the device-side
    table; ``table_lookup_ms_per_layer`` is then the median per-round cost of that lookup.
    The rounds also decode with the experts' computation skipped (``SkippedExperts``): its
    ratio to stock is the ceiling of what faster expert kernels can give this model."""
    import statistics

    import mlx_lm

    import moeflux_mlx

    models = {"stock mlx-lm": mlx_lm.load(str(stock_path))[0]}
    try:
        for b in backends:
            m, _ = moeflux_mlx.load(path, expert_io=io_mode, cache_budget="all", backend=b)
            name = f"moeflux {m.moeflux.backend.name}"
            if name in models:
                m.moeflux.close()
                continue
            models[name] = m
        direct = name
        if table:
            m, _ = moeflux_mlx.load(path, expert_io=io_mode, cache_budget="all",
                                    backend=backends[-1], device_table="all")
            if m.moeflux.cache.control is None:  # the table cannot run here
                m.moeflux.close()
                table = False
            else:
                models[f"{direct} table"] = m
        m, _ = moeflux_mlx.load(path, expert_io=io_mode, cache_budget="all", backend="ops")
        m.moeflux.backend = SkippedExperts()
        models[CEILING] = m
        for m in models.values():
            _time_generation(m, prompt, 4)  # warm-up: kernels of these shapes, allocator, fills
        tps = {k: [] for k in models}
        for _ in range(n):
            for k, m in models.items():
                tps[k].append(_time_generation(m, prompt, decode_tokens)[1])
    finally:
        for m in models.values():
            if hasattr(m, "moeflux"):
                m.moeflux.close()
        del models
        gc.collect()
        mx.clear_cache()
    stock = tps.pop("stock mlx-lm")
    out = {"rounds": n, "stock_tps": stock,
           "moeflux": {k: {"tps": v, "median_ratio": statistics.median(
               m / s for s, m in zip(stock, v))} for k, v in tps.items()}}
    if table:
        layers = _moe_layers(Path(path))
        out["table_lookup_ms_per_layer"] = statistics.median(
            1e3 * (1 / t - 1 / d) / layers for d, t in zip(tps[direct], tps[f"{direct} table"]))
    return out


def paired_backends(backend: Optional[str]) -> tuple:
    """Backends for the all-resident comparison: the one asked for, or on a GPU both the plain
    ops and the fused kernels (``auto``)."""
    if backend is not None:
        return (backend,)
    return ("ops", "auto") if mx.default_device() == mx.gpu else ("auto",)


def fits_for_stock(path: Path) -> bool:
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    weights += sum(f.stat().st_size for f in expert_files(path)) if is_packed(path) else 0
    return weights < 0.8 * psutil.virtual_memory().available


def run_benchmark(path, *, budgets=(1.0, 0.5, 0.25, 0.0), io_modes=("mmap", "pread"),
                  prompt_tokens=128, decode_tokens=64, stock=True, stock_path=None,
                  backend=None, prefetch=(False,), seed=0, repeats=1) -> dict:
    """Run every configuration and return a result dict (see ``write_results``).

    Where the device-side table is available, budgets below 100% run with both slot lookups
    (host sync per layer, device-side table), for the comparison. ``repeats`` > 1 also loads stock and
    the all-resident configuration side by side and lets them decode in turn that many times,
    for ratios that see through run-to-run noise."""
    from . import device_table
    path = Path(path)
    mx.random.seed(seed)
    prompt = mx.random.randint(0, 256, (prompt_tokens,)).astype(mx.uint32)
    bandwidth, warm_bandwidth = read_bandwidth(path)
    runs, failures = [], []
    stock_path = Path(stock_path or path)
    if stock and not is_packed(stock_path) and fits_for_stock(stock_path):
        runs.append(_run_stock(stock_path, prompt, decode_tokens))
    elif stock:
        log.warning("stock mlx-lm skipped: %s is a converted directory or does not fit in memory",
                    stock_path)
    # budgets below 100% run with both slot lookups where the device-side table is available
    lookups = (False, True) if device_table.available() else (None,)
    for io_mode in io_modes:
        for frac in budgets:
            for pf in prefetch if frac < 1 else (False,):
                # at 100%, "all" looks every (resident) expert up through the table: its own cost
                tables = lookups if frac < 1 else (None, "all") if lookups[-1] else (None,)
                for table in tables:
                    try:
                        runs.append(_run_moeflux(path, prompt, decode_tokens, io_mode, frac,
                                                 cold=frac < 1, bandwidth=bandwidth,
                                                 backend=backend, prefetch=pf, device_table=table))
                    except DeviceWaitError as e:  # the table path stalled: say so, go on
                        log.warning("%s %.0f%% with the device-side table failed: %s", io_mode,
                                    100 * frac, e)
                        failures.append(f"{io_mode} {frac:.0%} device table: {e}")
    ref = runs[0] if runs and runs[0].name.startswith("stock") else None
    for r in runs:
        if ref is not None:
            r.ratio_to_stock = r.decode_tps / ref.decode_tps
    paired = _paired_resident(path, stock_path, prompt, decode_tokens, io_modes[0],
                              paired_backends(backend), repeats, table=device_table.available()
                              ) if ref is not None and repeats > 1 else None
    layers = _moe_layers(path)
    return {
        "sync_overhead_ms_per_layer": sync_overhead(runs, layers),
        "device_lookup_overhead_ms_per_layer": sync_overhead(runs, layers, "device"),
        "device_lookup_only_ms_per_layer": sync_overhead(runs, layers, "device", "100%"),
        "paired_resident": paired,
        "failures": failures,
        "model": str(path),
        "machine": machine_name(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "cold_read_gb_s": bandwidth / 1e9,
        "page_cache_read_gb_s": warm_bandwidth / 1e9,
        "tokens_identical_to_stock": None if ref is None else
        {f"{r.name} {r.io_mode} {r.budget} {r.lookup}": r.tokens == ref.tokens for r in runs[1:]},
        "runs": [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in runs],
    }


def machine_name() -> str:
    gpu = ""
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        try:
            import subprocess

            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            gpu = "CUDA GPU"
    cpu = f"{platform.machine()} {psutil.cpu_count()} cores {psutil.virtual_memory().total / 2**30:.0f} GiB"
    return f"{gpu}, {cpu}" if gpu else cpu


def machine_tag(machine: str) -> str:
    """A short name for result files: ``h100`` for "NVIDIA H100 80GB HBM3, ...", ``cpu2``."""
    gpu = machine.split(",")[0] if "," in machine else ""
    words = [w for w in gpu.split() if w.upper() not in ("NVIDIA", "TESLA", "GEFORCE")
             and not w.upper().endswith("GB")]
    return words[0].lower() if words else f"cpu{psutil.cpu_count()}"


COLUMNS = [("name", "config", "{}"), ("io_mode", "io", "{}"), ("budget", "cache", "{}"),
           ("lookup", "lookup", "{}"),
           ("prompt_tps", "prompt tok/s", "{:.1f}"), ("decode_tps", "decode tok/s", "{:.2f}"),
           ("ratio_to_stock", "x stock", "{:.2f}"), ("mb_read_per_token", "MB read/tok", "{:.1f}"),
           ("hit_rate", "hit", "{:.0%}"),
           ("prefetch_issued_per_token", "read ahead/tok", "{:.1f}"),
           ("prefetch_hits_per_token", "prefetched/tok", "{:.1f}"),
           ("sync_ms_per_token", "sync ms/tok", "{:.2f}"),
           ("io_ms_per_token", "io ms/tok", "{:.2f}"), ("upload_ms_per_token", "upload ms/tok", "{:.2f}"),
           ("gpu_waits_per_token", "GPU waits/tok", "{:.2f}"),
           ("gpu_wait_ms_per_token", "GPU wait ms/tok", "{:.2f}"),
           ("other_ms_per_token", "rest ms/tok", "{:.2f}"), ("io_bound_tps", "I/O bound tok/s", "{:.1f}"),
           ("fraction_of_io_bound", "of bound", "{:.0%}"), ("peak_memory_gb", "peak GB", "{:.2f}")]


def format_table(result: dict) -> str:
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in result["runs"]:
        cells = [("-" if r[k] is None else f.format(r[k])) for k, _, f in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_lines(result: dict) -> List[str]:
    out = []
    for key, what in (("sync_overhead_ms_per_layer", "host sync (99% budget, nearly all hits, "
                       "the misses' reads included"),
                      ("device_lookup_overhead_ms_per_layer", "device-side table (99% budget, "
                       "nearly all hits, the misses' reads and waits included"),
                      ("device_lookup_only_ms_per_layer", "device-side table alone (100% budget, "
                       "every expert resident and looked up")):
        if result.get(key) is not None:
            note = " (negative: within run-to-run noise)" if result[key] < 0 else ""
            out.append(f"Slot lookup overhead per MoE layer, {what}; vs 100% looking nothing "
                       f"up): {result[key]:.3f} ms{note}")
    out += [f"FAILED: {f}" for f in result.get("failures", [])]
    paired = result.get("paired_resident")
    if paired:
        line = (f"All experts resident vs stock, all loaded in one process and decoding in turn, "
                f"{paired['rounds']} rounds: stock " + ", ".join(f"{v:.3g}" for v in paired["stock_tps"])
                + " tok/s")
        for name, r in paired["moeflux"].items():
            line += (f"; {name} " + ", ".join(f"{v:.3g}" for v in r["tps"])
                     + f" tok/s, median ratio to stock {r['median_ratio']:.2f}x")
        out.append(line)
        ceiling = paired["moeflux"].get(CEILING)
        if ceiling is not None:
            out.append("Ceiling: with the experts' computation skipped (no weight read, no kernel), "
                       f"the rest of the model decodes at {ceiling['median_ratio']:.2f}x stock; "
                       "no expert kernel can make this model faster than that.")
        if paired.get("table_lookup_ms_per_layer") is not None:
            out.append("Slot lookup overhead per MoE layer, device-side table alone, from those "
                       "rounds (the kernels with and without every expert looked up, median): "
                       f"{paired['table_lookup_ms_per_layer']:.3f} ms")
    return out


def write_results(result: dict, out_dir: Path, stem: str) -> List[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    written[0].write_text(json.dumps(result, indent=1))
    md = [f"# Decode benchmark: {Path(result['model']).name}", "",
          f"Machine: {result['machine']}; MLX {result['mlx']} ({result['device']}).",
          f"Random expert-sized reads of the expert files (8 threads): cold "
          f"{result['cold_read_gb_s']:.2f} GB/s, from the page cache "
          f"{result.get('page_cache_read_gb_s', float('nan')):.2f} GB/s. The I/O bound uses the cold figure.",
          "Budgets below 100% run cold: during pread runs a separate process keeps dropping the expert files "
          "from the page cache (as if the experts were many times RAM); mmap runs are cold only at "
          "their start (mapped pages cannot be dropped).", "",
          format_table(result), ""]
    md += [line if line.endswith(".") else line + "." for line in summary_lines(result)]
    if result["tokens_identical_to_stock"] is not None:
        same = result["tokens_identical_to_stock"]
        md.append(f"Greedy tokens identical to stock mlx-lm: {sum(same.values())}/{len(same)} runs.")
    written[1].write_text("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(6, 4))
    for io_mode in sorted({r["io_mode"] for r in result["runs"] if r["io_mode"] != "-"}):
        rs = [r for r in result["runs"] if r["io_mode"] == io_mode]
        for pf in (False, True):
            sel = [r for r in rs if r["name"].endswith("+prefetch") == pf or r["budget"] == "100%"]
            if pf and len(sel) <= 1:
                continue
            ax.plot([float(r["budget"].rstrip("%")) for r in sel], [r["decode_tps"] for r in sel],
                    marker="o", label=f"moeflux {io_mode}" + (" +prefetch" if pf else ""))
    stock = [r for r in result["runs"] if r["name"].startswith("stock")]
    if stock:
        ax.axhline(stock[0]["decode_tps"], color="gray", linestyle="--", label="stock mlx-lm")
    ax.set_xlabel("expert cache budget (% of experts)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(result["machine"], fontsize=8)
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / f"{stem}.png")
    fig.savefig(written[-1], dpi=120)
    return written


def add_args(p) -> None:
    """Arguments of ``moeflux-mlx bench`` and ``benchmarks/decode.py``."""
    from . import synth

    p.add_argument("model", nargs="?", type=Path, help="checkpoint to benchmark, plain or "
                   "converted (default: build a random-weight one with --arch/--size)")
    p.add_argument("--arch", default="qwen3_moe", choices=synth.ARCHITECTURES)
    p.add_argument("--size", default="small", choices=synth.SIZES)
    p.add_argument("--layers", type=int, help="number of decoder layers of the built model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config field of the built model, e.g. num_experts=16 (JSON value)")
    p.add_argument("--build-dir", type=Path, default=Path(".cache/bench-models"))
    p.add_argument("--budgets", default="1,0.99,0.5,0.25,0",
                   help="cache budgets as fractions of the experts (0.99: nearly all hits, one "
                        "sync per layer: measures the sync overhead)")
    p.add_argument("--io", default="mmap,pread", help="I/O modes to run")
    p.add_argument("--prefetch", default="both", choices=["off", "on", "both"])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--bench-backend", default=None, help="expert backend (default: auto)")
    p.add_argument("--no-stock", action="store_true", help="skip stock mlx-lm")
    p.add_argument("--convert", action="store_true",
                   help="stream the experts from a converted copy (MODEL-packed, made once), as "
                        "for a model larger than RAM; stock mlx-lm runs from MODEL")
    p.add_argument("--repeats", type=int, default=1,
                   help="with N > 1: also load stock and the all-resident configuration (on a GPU "
                        "with the ops and the kernel backends) side by side and let them decode "
                        "in turn N times; report the median ratio (run-to-run noise)")
    p.add_argument("--machine", default=None, help="machine label for the results file name")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))


def parse_config_setting(text: str):
    """``"num_experts=16"`` -> ``("num_experts", 16)`` (the value read as JSON, else a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run_cli(args) -> int:
    import datetime

    from . import synth

    model = args.model
    if model is None:
        overrides = dict(parse_config_setting(v) for v in args.set)
        name = f"{args.arch}-{args.size}" + "".join(f"-{k}{v}" for k, v in overrides.items())
        if args.layers:
            overrides["num_hidden_layers"] = args.layers
            name += f"-{args.layers}l"
        model = args.build_dir / name
        if not model.exists():
            synth.build_checkpoint(model, args.arch, args.size, overrides=overrides or None)
    stock_path = None
    if args.convert and not is_packed(model):
        # one contiguous blob per expert; a plain checkpoint scatters each over nine ranges,
        # which read cold at ~0.8x the speed (benchmarks/results/2026-11-24-h100-notes.md)
        from .convert import convert

        packed = model.with_name(model.name + "-packed")
        if not packed.exists():
            convert(model, packed)
        model, stock_path = packed, model
    result = run_benchmark(
        model, budgets=[float(b) for b in args.budgets.split(",")], io_modes=args.io.split(","),
        prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
        stock=not args.no_stock, stock_path=stock_path, backend=args.bench_backend,
        repeats=args.repeats,
        prefetch={"off": (False,), "on": (True,), "both": (False, True)}[args.prefetch])
    print(format_table(result))
    for line in summary_lines(result):
        print(line)
    machine = args.machine or machine_tag(result["machine"])
    for f in write_results(result, args.out, f"{datetime.date.today()}-{machine}-decode"):
        print("wrote", f)
    return 0
