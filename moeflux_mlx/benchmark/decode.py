"""The decode benchmark: stock mlx-lm and moeflux-mlx side by side, in one process and one run.

For each configuration (stock when the model fits; moeflux at several cache budgets and both
I/O modes) it times prefill and greedy decode, and reads the streaming counters: experts and
bytes read per token, hit rate, time per token in sync / I/O / upload. It also measures the cold
read bandwidth of the disk holding the experts and the decode rate that bandwidth allows for the
bytes actually missed per token (the I/O bound). ``report`` formats and writes the results.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Union

import mlx.core as mx
import psutil
from mlx_lm.generate import generate_step

from ..errors import DeviceWaitError
from ..format.checkpoint import expert_layout, is_packed
from ..model.load import load
from ..model.runtime import use_table
from ..options import LoadOptions
from .pagecache import (
    PageCacheDropper,
    RamBalloon,
    cached_bytes,
    can_hold_ram,
    cold_bandwidth,
    device_read_bytes,
    drop_page_cache,
    expert_files,
    read_bandwidth,
)
from .report import CEILING, machine_name

log = logging.getLogger(__name__)

# how cold runs treat the page cache (run_benchmark's page_cache; or a share of the experts)
PAGE_CACHE_CHOICES = ("dropped", "kept")


def check_page_cache(page_cache: Union[str, float]) -> None:
    """Raises ValueError unless ``page_cache`` is one of ``PAGE_CACHE_CHOICES`` or a share of
    the experts in (0, 1]."""
    if isinstance(page_cache, str):
        if page_cache not in PAGE_CACHE_CHOICES:
            raise ValueError(
                f"page_cache {page_cache!r}: expected one of {', '.join(PAGE_CACHE_CHOICES)} "
                "or a share of the experts in (0, 1]"
            )
    elif not 0 < page_cache <= 1:
        raise ValueError(f"page_cache {page_cache}: a share of the experts must be in (0, 1]")
    else:
        why = can_hold_ram()
        if why:
            raise ValueError(f"page_cache {page_cache}: {why}")


@dataclass
class DecodeRun:
    name: str
    io_mode: str = "-"
    budget: str = "-"  # fraction of the experts held in the cache
    lookup: str = (
        "-"  # decode slot lookup: "device" (GPU table, host only on misses), "host" (sync)
    )
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
    sync_ms_per_token: float = (
        0.0  # waiting for router indices: includes device compute before them
    )
    io_ms_per_token: float = 0.0
    upload_ms_per_token: float = 0.0
    gpu_waits_per_token: float = 0.0  # device-side table: GPU waits for the miss server
    gpu_wait_ms_per_token: float = 0.0  # their time, the server's reads included
    other_ms_per_token: float = 0.0
    # cold runs: the disk's cold bandwidth measured right before and right after the timed
    # decode, their mean the bound's (a VM disk's rate moves by a third within minutes)
    cold_gb_s: Optional[float] = None
    cold_gb_s_before_after: Optional[List[float]] = None
    io_bound_tps: Optional[float] = None
    fraction_of_io_bound: Optional[float] = None
    # cold runs: the experts' bytes the page cache held when the decode ended (page_cache="kept":
    # what RAM let it keep; None: unknown)
    page_cache_mb: Optional[float] = None
    # cold runs: what the disk holding the experts read per token (every process's reads, whole
    # pages); roughly, the rest of MB read/tok came from the page cache (None: no block device)
    disk_mb_per_token: Optional[float] = None
    # page_cache=SHARE: the most RAM the balloon held to leave the page cache that share
    ram_held_gb: Optional[float] = None
    peak_memory_gb: float = 0.0
    tokens: List[int] = field(default_factory=list, repr=False)


def load_for_benchmark(path, device_table=None, **options):
    """``load`` with the benchmark's choice of slot lookup: ``device_table`` None (where CUDA
    is), True, False, or ``"all"``: every layer through the device-side table, fully cached ones
    included (what the lookup itself costs)."""
    every = device_table == "all"
    return load(
        path,
        options=LoadOptions.resolve(
            device_table=True if every else device_table, table_every_layer=every or None, **options
        ),
    )


def timed_greedy(model, prompt: mx.array, decode_tokens: int, on_first=None):
    """Greedy decode of ``decode_tokens`` tokens after the first, timed.

    Args:
        model: an mlx-lm model.
        prompt: the prompt's token ids.
        decode_tokens: tokens decoded after the first (the end of prefill).
        on_first: called after the first token, before decode timing starts.

    Returns:
        ``(tokens, log-probs, prefill seconds, decode seconds)``: every token, the first
        included, and each step's log-probs, left on the device (copied out by the caller
        after the timed loop, if at all).
    """
    mx.synchronize()
    t0 = time.perf_counter()
    gen = generate_step(prompt, model, max_tokens=decode_tokens + 1)
    tok, lp = next(gen)
    tokens, logprobs = [int(tok)], [lp]
    t1 = time.perf_counter()
    if on_first:
        on_first()
    t2 = time.perf_counter()
    for tok, lp in gen:
        tokens.append(int(tok))
        logprobs.append(lp)
    mx.synchronize()
    return tokens, logprobs, t1 - t0, time.perf_counter() - t2


def _time_generation(model, prompt: mx.array, decode_tokens: int, on_first=None):
    """Greedy decode; returns (prompt_tps, decode_tps, tokens, decode seconds) (see
    ``timed_greedy``)."""
    tokens, _, prefill_s, decode_s = timed_greedy(model, prompt, decode_tokens, on_first)
    return prompt.size / prefill_s, (len(tokens) - 1) / decode_s, tokens, decode_s


def _as_is(model) -> None:
    """The models as loaded (``run_benchmark``'s ``prepare`` hook does nothing)."""


def _run_stock(path, prompt, decode_tokens, prepare=_as_is) -> DecodeRun:
    import mlx_lm

    model, _ = mlx_lm.load(str(path))
    prepare(model)
    _time_generation(model, prompt, 4)  # warm-up: kernels of these shapes, allocator
    mx.reset_peak_memory()
    ptps, dtps, tokens, _ = _time_generation(model, prompt, decode_tokens)
    run = DecodeRun(
        "stock mlx-lm",
        prompt_tokens=prompt.size,
        prompt_tps=ptps,
        decode_tokens=len(tokens) - 1,
        decode_tps=dtps,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        tokens=tokens,
    )
    del model
    gc.collect()
    mx.clear_cache()
    return run


class _DiskReads:
    """The bytes the disk holding ``path`` read from ``start()`` to ``since()``."""

    def __init__(self, path: Path):
        self.path = path
        self.first: Optional[int] = None  # set when the timed decode starts

    def start(self) -> None:
        self.first = device_read_bytes(self.path)

    def since(self) -> Optional[int]:
        now = device_read_bytes(self.path)
        return None if now is None or self.first is None else now - self.first


def _run_moeflux(
    path,
    prompt,
    decode_tokens,
    io_mode,
    budget_fraction,
    cold,
    bandwidth,
    backend=None,
    prefetch=False,
    device_table=None,
    prepare=_as_is,
    page_cache="dropped",
) -> DecodeRun:
    total = expert_layout(path).total_expert_bytes
    budget = "all" if budget_fraction >= 1 else int(budget_fraction * total)
    model, _ = load_for_benchmark(
        path,
        device_table,
        expert_io=io_mode,
        cache_budget=budget,
        backend=backend,
        prefetch=prefetch,
    )
    prepare(model)
    rt = model.moeflux
    try:
        _time_generation(model, prompt, 4)  # warm-up: kernels of these shapes, allocator, fills
        files = expert_files(path)
        around = [cold_bandwidth(path)] if cold and bandwidth else []
        # pread + cold: keep dropping the page cache while decoding, as if the experts were many
        # times RAM (mapped pages cannot be dropped: mmap runs are cold only at their start);
        # "kept": cold at the start only, then the page cache keeps what RAM lets it keep; a
        # share: the same, with all of RAM held but that share of the experts' bytes
        dropping = (
            PageCacheDropper(files)
            if cold and rt.store.io_mode != "mmap" and page_cache == "dropped"
            else contextlib.nullcontext()
        )
        ram = (
            RamBalloon(int(page_cache * total))
            if cold and not isinstance(page_cache, str)
            else contextlib.nullcontext()
        )
        with ram:  # held from before the drop to after the count of what the page cache held
            if cold:
                drop_page_cache(files)
            mx.reset_peak_memory()
            rt.reset_stats()
            disk = _DiskReads(files[0]) if cold else None

            def on_first():  # the timed decode starts: its counters and the disk's from zero
                rt.reset_stats()
                if disk is not None:
                    disk.start()

            with dropping:
                ptps, dtps, tokens, decode_s = _time_generation(
                    model, prompt, decode_tokens, on_first=on_first
                )
            rt.stats_dict()  # counts what the miss server read, if any
            held = cached_bytes(files) if cold else None
            disk_bytes = disk.since() if disk else None
        if around:
            around.append(cold_bandwidth(path))
            bandwidth = sum(around) / len(around)
        t = rt.stats.total()
        n = max(len(tokens) - 1, 1)
        table = rt.cache.name == "table"
        lookup = (
            "-" if t.calls == t.unsynced_calls and not table else ("device" if table else "host")
        )
        run = DecodeRun(
            f"moeflux {rt.backend.name}" + (" +prefetch" if prefetch else ""),
            io_mode=rt.store.io_mode,
            budget=f"{budget_fraction:.0%}",
            lookup=lookup,
            cold=cold,
            prompt_tokens=prompt.size,
            prompt_tps=ptps,
            decode_tokens=n,
            decode_tps=dtps,
            experts_read_per_token=t.experts_read / n,
            mb_read_per_token=t.bytes_read / n / 1e6,
            hit_rate=rt.stats.hit_rate if t.experts_routed else None,
            prefetch_issued_per_token=t.prefetch_issued / n,
            prefetch_hits_per_token=t.prefetch_hits / n,
            sync_ms_per_token=1e3 * t.sync_s / n,
            io_ms_per_token=1e3 * t.io_s / n,
            upload_ms_per_token=1e3 * t.upload_s / n,
            gpu_waits_per_token=t.gpu_waits / n,
            gpu_wait_ms_per_token=1e3 * t.gpu_wait_s / n,
            # the device table's reads happen inside the GPU's waits
            other_ms_per_token=1e3
            * (decode_s - t.sync_s - max(t.io_s, t.gpu_wait_s) - t.upload_s)
            / n,
            page_cache_mb=None if held is None else held / 1e6,
            ram_held_gb=ram.held_bytes / 1e9 if isinstance(ram, RamBalloon) else None,
            disk_mb_per_token=None if disk_bytes is None else disk_bytes / n / 1e6,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            tokens=tokens,
        )
        if around:
            run.cold_gb_s = bandwidth / 1e9
            run.cold_gb_s_before_after = [b / 1e9 for b in around]
        # the bound is the disk's: with the page cache kept, what the disk itself read
        from_disk = t.bytes_read if page_cache == "dropped" else disk_bytes
        if from_disk and bandwidth:
            run.io_bound_tps = bandwidth / (from_disk / n)
            run.fraction_of_io_bound = dtps / run.io_bound_tps
        return run
    finally:
        rt.close()
        del model
        gc.collect()
        mx.clear_cache()


def _moe_layers(path: Path) -> int:
    return len(expert_layout(path).layers)


def sync_overhead(
    runs: List[DecodeRun], moe_layers: int, lookup: str = "host", budget: str = "99%"
) -> Optional[float]:
    """ms per MoE layer that a layer's slot lookup costs: the run at ``budget`` with ``lookup``
    (``host``: one sync per layer, ``device``: the GPU table; 99%: nearly all hits, the few
    misses' reads included; 100% with the device table: every expert resident and still
    looked up, the lookup alone) against the 100% run that looks nothing up (slot == expert
    id), same I/O mode."""
    by = {(r.io_mode, r.budget, r.lookup): r for r in runs if not r.name.endswith("+prefetch")}
    deltas = [
        1e3 * (1 / by[(io, budget, lookup)].decode_tps - 1 / r.decode_tps) / moe_layers
        for (io, b, lk), r in by.items()
        if b == "100%" and lk == "-" and (io, budget, lookup) in by
    ]
    return min(deltas) if deltas else None


class SkippedExperts:
    """A stand-in backend that reads no expert weight and launches no kernel: it hands ``x`` back
    as every expert's output (``[..., K, H]``, a broadcast). Decode with it is the fastest any
    expert kernel could make the model: the rest of the model alone. Tokens are meaningless."""

    name = "experts skipped"

    def __call__(self, x: mx.array, slots: mx.array, pool, activation) -> mx.array:
        shape = (*x.shape[:-1], slots.shape[-1], x.shape[-1])
        return mx.broadcast_to(mx.expand_dims(x, -2), shape)


def _paired_resident(
    path,
    stock_path,
    prompt,
    decode_tokens,
    io_mode,
    backends,
    n,
    table: bool = False,
    prepare=_as_is,
) -> dict:
    """Stock mlx-lm and moeflux with every expert resident (one model per backend), all loaded
    at once and decoding in turn, ``n`` rounds: decode tok/s of each, and per backend the median
    of its per-round ratio to stock (slow drifts of the machine hit both sides of a round).
    ``table``: the last backend once more, every expert looked up through the device-side
    table; ``table_lookup_ms_per_layer`` is then the median per-round cost of that lookup.
    The rounds also decode with the experts' computation skipped (``SkippedExperts``): its
    ratio to stock is the ceiling of what faster expert kernels can give this model."""
    import statistics

    import mlx_lm

    models = {"stock mlx-lm": mlx_lm.load(str(stock_path))[0]}
    try:
        for b in backends:
            m, _ = load(path, expert_io=io_mode, cache_budget="all", backend=b)
            name = f"moeflux {m.moeflux.backend.name}"
            if name in models:
                m.moeflux.close()
                continue
            models[name] = m
        direct = name
        if table:
            m, _ = load_for_benchmark(
                path, "all", expert_io=io_mode, cache_budget="all", backend=backends[-1]
            )
            if m.moeflux.cache.name != "table":  # the table cannot run here
                m.moeflux.close()
                table = False
            else:
                models[f"{direct} table"] = m
        m, _ = load(path, expert_io=io_mode, cache_budget="all", backend="ops")
        m.moeflux.backend = SkippedExperts()
        models[CEILING] = m
        for m in models.values():
            prepare(m)
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
    out = {
        "rounds": n,
        "stock_tps": stock,
        "moeflux": {
            k: {"tps": v, "median_ratio": statistics.median(m / s for s, m in zip(stock, v))}
            for k, v in tps.items()
        },
    }
    if table:
        layers = _moe_layers(Path(path))
        out["table_lookup_ms_per_layer"] = statistics.median(
            1e3 * (1 / t - 1 / d) / layers for d, t in zip(tps[direct], tps[f"{direct} table"])
        )
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


def run_benchmark(
    path,
    *,
    budgets=(1.0, 0.5, 0.25, 0.0),
    io_modes=("mmap", "pread"),
    prompt_tokens=128,
    prompt=None,
    decode_tokens=64,
    stock=True,
    stock_path=None,
    backend=None,
    prefetch=(False,),
    seed=0,
    repeats=1,
    prepare=_as_is,
    page_cache="dropped",
    lookup="both",
) -> dict:
    """Run every configuration and return a result dict (see ``write_results``).

    Where the device-side table is available, budgets below 100% run with both slot lookups
    (host sync per layer, device-side table), for the comparison. ``repeats`` > 1 also loads stock and
    the all-resident configuration side by side and lets them decode in turn that many times,
    for ratios that see through run-to-run noise. ``prepare(model)`` runs on every model right
    after it is loaded (``trace_routing.drive_routing``: routing replayed from a trace).
    ``prompt``: token ids to start from (the first ``prompt_tokens``; default: random ids), so a
    trained model decodes text and routes as it would for a user. ``page_cache``: ``dropped``
    (the cold runs' page cache is dropped all along, as for experts many times RAM), ``kept``
    (dropped once before the prompt; then it keeps what RAM lets it keep: a model larger than
    RAM as it runs), or a share in (0, 1]: kept, while a process holds all of RAM but that
    share of the experts' bytes (``RamBalloon``; Linux): experts a few times RAM, on a machine
    whose RAM holds them all. ``lookup``: where the table can run, budgets below 100% decode
    with ``both`` slot lookups, only the ``device``'s or only the ``host``'s."""
    check_page_cache(page_cache)
    path = Path(path)
    prepare = prepare or _as_is
    mx.random.seed(seed)
    if prompt is None:  # random ids: a random-weight model has no text to be given
        prompt = mx.random.randint(0, 256, (prompt_tokens,)).astype(mx.uint32)
    else:
        prompt = mx.array(list(prompt)[:prompt_tokens], dtype=mx.uint32)
    warm_bandwidth = read_bandwidth(path)[1]
    bandwidth = cold_bandwidth(path)
    runs, failures = [], []
    stock_path = Path(stock_path or path)
    if stock and not is_packed(stock_path) and fits_for_stock(stock_path):
        runs.append(_run_stock(stock_path, prompt, decode_tokens, prepare))
    elif stock:
        log.warning(
            "stock mlx-lm skipped: %s is a converted directory or does not fit in memory",
            stock_path,
        )
    # budgets below 100% run with both slot lookups where the device-side table is available
    lookups = (False, True) if use_table(None) else (None,)
    if len(lookups) == 2 and lookup != "both":
        lookups = (lookup == "device",)
    for io_mode in io_modes:
        for frac in budgets:
            for pf in prefetch if frac < 1 else (False,):
                # at 100%, "all" looks every (resident) expert up through the table: its own cost
                tables = lookups if frac < 1 else (None, "all") if lookups[-1] else (None,)
                for table in tables:
                    try:
                        runs.append(
                            _run_moeflux(
                                path,
                                prompt,
                                decode_tokens,
                                io_mode,
                                frac,
                                cold=frac < 1,
                                bandwidth=bandwidth,
                                backend=backend,
                                prefetch=pf,
                                device_table=table,
                                prepare=prepare,
                                page_cache=page_cache,
                            )
                        )
                    except DeviceWaitError as e:  # the table path stalled: say so, go on
                        log.warning(
                            "%s %.0f%% with the device-side table failed: %s",
                            io_mode,
                            100 * frac,
                            e,
                        )
                        failures.append(f"{io_mode} {frac:.0%} device table: {e}")
    ref = runs[0] if runs and runs[0].name.startswith("stock") else None
    for r in runs:
        if ref is not None:
            r.ratio_to_stock = r.decode_tps / ref.decode_tps
    paired = (
        _paired_resident(
            path,
            stock_path,
            prompt,
            decode_tokens,
            io_modes[0],
            paired_backends(backend),
            repeats,
            table=use_table(None),
            prepare=prepare,
        )
        if ref is not None and repeats > 1
        else None
    )
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
        "page_cache": page_cache,
        "tokens_identical_to_stock": None
        if ref is None
        else {
            f"{r.name} {r.io_mode} {r.budget} {r.lookup}": r.tokens == ref.tokens for r in runs[1:]
        },
        "runs": [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in runs],
    }
