"""The decode benchmark's research runs: stock mlx-lm and moeflux-mlx side by side, in one
process and one run, built on the product's runner (``moeflux_mlx.measure``).

For each configuration (stock when the model fits; moeflux at several cache budgets and I/O modes,
both slot lookups where the device-side table runs) it times prefill and greedy
decode, and reads the streaming counters: experts and bytes read per token, hit rate, time per
token in sync / I/O / upload. Budgets below 100% run cold (the page cache dropped all along, once,
or held to a share of the experts); the disk's cold read bandwidth gives the decode rate it
allows for the bytes actually missed per token (the I/O bound). ``report`` formats and writes
the results.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

import mlx.core as mx

from benchmarks.lib.pagecache import (
    RamBalloon,
    cached_bytes,
    can_hold_ram,
    cold_bandwidth,
    device_read_bytes,
)
from benchmarks.lib.report import CEILING
from moeflux_mlx import measure
from moeflux_mlx.errors import DeviceWaitError
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.io.bandwidth import PageCacheDropper, drop_page_cache, expert_files, read_bandwidth
from moeflux_mlx.model.load import load
from moeflux_mlx.model.runtime import use_table
from moeflux_mlx.options import LoadOptions, Tuning

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
class DecodeRun(measure.DecodeRun):
    """A research run: the product's fields, and what the cold runs and the slot lookups add."""

    lookup: str = (
        "-"  # decode slot lookup: "device" (GPU table, host only on misses), "host" (sync)
    )
    cold: bool = False
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
    # the store's first-read CRC-32 checks during the timed decode: their share of its read
    # time (io ms/tok; None: no read time) and of its decode time
    checksum_of_io: Optional[float] = None
    checksum_of_decode: Optional[float] = None
    # every check since the model was loaded: the cache's fill, the warm-up and the timed
    # prompt included (each expert is checked once, at its first read)
    checksum_since_load_s: Optional[float] = None
    checksum_since_load_mb: Optional[float] = None

    def label(self) -> str:
        return f"{super().label()} {self.lookup}"


def load_for_benchmark(path, device_table=None, **options):
    """``load`` with the benchmark's choice of slot lookup, which the machine makes for a user
    (``Tuning.device_table``): None (where CUDA is), True or False."""
    return load(
        path,
        options=LoadOptions.resolve(tuning=Tuning(device_table=device_table), **options),
    )


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


class ColdTiming(measure.Timing):
    """The research runs' hooks around a timed decode: a cold run (``cold``) drops the expert
    files from the page cache before the prompt and, by ``page_cache``, keeps dropping them
    throughout (``dropped``: pread and direct; mapped pages cannot be dropped, so mmap runs are
    cold only at their start), lets the page cache keep what RAM lets it keep (``kept``), or
    holds all of RAM but that share of the experts' bytes around it (a float). It measures the
    disk's cold rate right before and after (the I/O bound's), what the disk read, and what
    the page cache held at the end; ``finish`` adds those, and the lookups' and the device
    table's counters, to the run."""

    def __init__(self, model, path: Path, cold: bool, bandwidth, page_cache):
        self.rt, self.path, self.cold = model.moeflux, Path(path), cold
        self.bandwidth, self.page_cache = bandwidth, page_cache
        self.files = expert_files(path)
        self.total = expert_layout(path).total_expert_bytes
        self.around: List[float] = []
        self.disk = _DiskReads(self.files[0]) if cold else None
        self.held: Optional[int] = None
        self.disk_bytes: Optional[int] = None
        self.ram: Optional[RamBalloon] = None
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        if self.cold and self.bandwidth:
            self.around = [cold_bandwidth(self.path)]
        # unwound in reverse: the dropper stops, then what the page cache held and what the disk
        # read are counted, while the balloon still holds RAM, then the balloon goes
        with contextlib.ExitStack() as stack:
            if self.cold and not isinstance(self.page_cache, str):
                self.ram = RamBalloon(int(self.page_cache * self.total))
                stack.enter_context(self.ram)
            if self.cold:
                drop_page_cache(self.files)
                stack.callback(self._count)
            if self.cold and self.rt.store.io_mode != "mmap" and self.page_cache == "dropped":
                stack.enter_context(PageCacheDropper(self.files))
            self._stack = stack.pop_all()
        return self

    def start(self) -> None:
        if self.disk is not None:
            self.disk.start()

    def __exit__(self, *exc):
        stack, self._stack = self._stack, contextlib.ExitStack()
        return stack.__exit__(*exc)

    def _count(self) -> None:
        self.held = cached_bytes(self.files)
        self.disk_bytes = self.disk.since() if self.disk is not None else None

    def finish(self, run: DecodeRun, model, decode_s: float) -> None:
        rt = model.moeflux
        t = rt.stats.total()
        n = run.decode_tokens
        table = rt.cache.name == "table"
        run.lookup = (
            "-" if t.calls == t.unsynced_calls and not table else ("device" if table else "host")
        )
        run.cold = self.cold
        run.gpu_waits_per_token = t.gpu_waits / n
        run.gpu_wait_ms_per_token = 1e3 * t.gpu_wait_s / n
        # the device table's reads happen inside the GPU's waits
        run.other_ms_per_token = (
            1e3 * (decode_s - t.sync_s - max(t.io_s, t.gpu_wait_s) - t.upload_s) / n
        )
        run.page_cache_mb = None if self.held is None else self.held / 1e6
        run.ram_held_gb = None if self.ram is None else self.ram.held_bytes / 1e9
        run.disk_mb_per_token = None if self.disk_bytes is None else self.disk_bytes / n / 1e6
        if run.io_ms_per_token:
            run.checksum_of_io = run.checksum_ms_per_token / run.io_ms_per_token
        run.checksum_of_decode = run.checksum_ms_per_token * n / 1e3 / decode_s
        checked_s, checked_bytes = rt.store.checksum_cost()
        run.checksum_since_load_s = checked_s
        run.checksum_since_load_mb = checked_bytes / 1e6
        bandwidth = self.bandwidth
        if self.around:
            self.around.append(cold_bandwidth(self.path))
            bandwidth = sum(self.around) / len(self.around)
            run.cold_gb_s = bandwidth / 1e9
            run.cold_gb_s_before_after = [b / 1e9 for b in self.around]
        # the bound is the disk's: with the page cache kept, what the disk itself read
        from_disk = t.bytes_read if self.page_cache == "dropped" else self.disk_bytes
        if from_disk and bandwidth:
            run.io_bound_tps = bandwidth / (from_disk / n)
            run.fraction_of_io_bound = run.decode_tps / run.io_bound_tps


def _run_moeflux(
    path,
    prompt,
    decode_tokens,
    io_mode,
    budget_fraction,
    cold,
    bandwidth,
    backend=None,
    device_table=None,
    prepare=measure.as_is,
    page_cache="dropped",
) -> DecodeRun:
    model, _ = load_for_benchmark(
        path,
        device_table,
        expert_io=io_mode,
        cache_budget=measure.cache_budget(path, budget_fraction),
        backend=backend,
    )
    prepare(model)
    timing = ColdTiming(model, path, cold, bandwidth, page_cache)
    return measure.run_moeflux(
        model, prompt, decode_tokens, budget_fraction, run_type=DecodeRun, timing=timing
    )


def _moe_layers(path: Path) -> int:
    return len(expert_layout(path).layers)


def sync_overhead(
    runs: List[DecodeRun], moe_layers: int, lookup: str = "host", budget: str = "99%"
) -> Optional[float]:
    """ms per MoE layer that a layer's slot lookup costs: the run at ``budget`` with ``lookup``
    (``host``: one sync per layer, ``device``: the GPU table; 99%: nearly all hits, the few
    misses' reads included) against the 100% run that looks nothing up (slot == expert id),
    same I/O mode."""
    by = {(r.io_mode, r.budget, r.lookup): r for r in runs}
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
    prepare=measure.as_is,
) -> dict:
    """Stock mlx-lm and moeflux with every expert resident (one model per backend), all loaded
    at once and decoding in turn, ``n`` rounds: decode tok/s of each, and per backend the median
    of its per-round ratio to stock (slow drifts of the machine hit both sides of a round).
    The rounds also decode with the experts' computation skipped (``SkippedExperts``): its
    ratio to stock is the ceiling of what faster expert kernels can give this model."""
    import statistics

    import mlx_lm

    models = {measure.STOCK: mlx_lm.load(str(stock_path))[0]}
    try:
        for b in backends:
            m, _ = load(path, expert_io=io_mode, cache_budget="all", backend=b)
            name = f"moeflux {m.moeflux.backend.name}"
            if name in models:
                m.moeflux.close()
                continue
            models[name] = m
        m, _ = load(path, expert_io=io_mode, cache_budget="all", backend="ops")
        m.moeflux.backend = SkippedExperts()
        models[CEILING] = m
        for m in models.values():
            prepare(m)
            measure.time_generation(m, prompt, measure.WARM_UP_TOKENS)  # kernels, allocator, fills
        tps = {k: [] for k in models}
        for _ in range(n):
            for k, m in models.items():
                tps[k].append(measure.time_generation(m, prompt, decode_tokens)[1])
    finally:
        for m in models.values():
            if hasattr(m, "moeflux"):
                m.moeflux.close()
        del models
        measure._release()
    stock = tps.pop(measure.STOCK)
    out = {
        "rounds": n,
        "stock_tps": stock,
        "moeflux": {
            k: {"tps": v, "median_ratio": statistics.median(m / s for s, m in zip(stock, v))}
            for k, v in tps.items()
        },
    }
    return out


def paired_backends(backend: Optional[str]) -> tuple:
    """Backends for the all-resident comparison: the one asked for, or on a GPU both the plain
    ops and the fused kernels (``auto``)."""
    if backend is not None:
        return (backend,)
    return ("ops", "auto") if mx.default_device() == mx.gpu else ("auto",)


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
    seed=0,
    repeats=1,
    prepare=measure.as_is,
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
    prepare = prepare or measure.as_is
    prompt = measure.make_prompt(prompt_tokens, prompt, seed)
    warm_bandwidth = read_bandwidth(path)[1]
    bandwidth = cold_bandwidth(path)
    runs, failures = [], []
    stock_path = Path(stock_path or path)
    if stock and measure.can_run_stock(stock_path):
        runs.append(measure.run_stock(stock_path, prompt, decode_tokens, prepare, DecodeRun))
    # budgets below 100% run with both slot lookups where the device-side table is available
    lookups = (False, True) if use_table(Tuning()) else (None,)
    if len(lookups) == 2 and lookup != "both":
        lookups = (lookup == "device",)
    for io_mode in io_modes:
        for frac in budgets:
            # at 100% every expert is resident: nothing is looked up
            for table in lookups if frac < 1 else (None,):
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
                            device_table=table,
                            prepare=prepare,
                            page_cache=page_cache,
                        )
                    )
                except DeviceWaitError as e:  # the table path stalled: say so, go on
                    log.warning(
                        "%s %.0f%% with the device-side table failed: %s", io_mode, 100 * frac, e
                    )
                    failures.append(f"{io_mode} {frac:.0%} device table: {e}")
    ref = runs[0] if runs and runs[0].name == measure.STOCK else None
    paired = (
        _paired_resident(
            path,
            stock_path,
            prompt,
            decode_tokens,
            io_modes[0],
            paired_backends(backend),
            repeats,
            prepare=prepare,
        )
        if ref is not None and repeats > 1
        else None
    )
    layers = _moe_layers(path)
    return measure.result_dict(
        path,
        runs,
        sync_overhead_ms_per_layer=sync_overhead(runs, layers),
        device_lookup_overhead_ms_per_layer=sync_overhead(runs, layers, "device"),
        paired_resident=paired,
        failures=failures,
        cold_read_gb_s=bandwidth / 1e9,
        page_cache_read_gb_s=warm_bandwidth / 1e9,
        page_cache=page_cache,
    )
