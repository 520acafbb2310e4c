"""Where routed experts live in MLX memory: a pool of slots per layer.

A ``SlotPool`` holds, per component, one uint8 MLX array ``[n_slots, nbytes]`` plus typed views
of it for the kernels. On Metal and the CPU, experts read from disk are copied into their slots
through a writable host view of that very memory: no ``mx.array`` copy, no scatter. On CUDA,
where that memory is managed and lives on the GPU, they are read into host-resident staging and
scattered into the slots by the GPU (see upload.py for why and what it measured).

``StagingCache`` keeps nothing between calls: every call reads the routed experts into slots
``0..n-1``. ``ExpertCache`` keeps slots under a byte budget with LRU eviction; a layer whose
budget holds all its experts is filled once, on first use, with slot = expert id, and from then
on its router indices go to the kernels unchanged, with no host sync at all.

Writing a slot that a not-yet-evaluated computation still reads would change that computation's
answer. The streaming module enqueues every computation that reads a writable pool at once
(``mx.async_eval``), and writes only follow a host sync on work enqueued later on the same
in-order stream, so a pool never changes under a pending read.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np
import psutil

from . import device_table
from .backends import MX_DTYPES, ExpertPool
from .control_block import HOST_ADMIT, HOST_RELEASE
from .layout import ExpertLayout, ModelLayout
from .lru import SlotLRU
from .counters import LayerStats, Stats
from .store import ExpertStore  # or a prefetch.Prefetcher, which reads like one
from .upload import device_slot_writes, host_array, host_view

log = logging.getLogger(__name__)

DEFAULT_RAM_FRACTION = 0.4  # of physical RAM, when no budget is given and the experts do not fit
FILL_CHUNK_BYTES = 64 << 20
STAGING_KEEP_BYTES = 256 << 20  # larger staging and staging pools (prefill) are not kept


class DeviceStaging:
    """Host-resident staging for device slot writes, one buffer for every layer of a cache.

    Safe to share for the same reason a pool is safe to rewrite (module docstring). Requests
    over ``STAGING_KEEP_BYTES`` (prefill) get a buffer of their own that is not kept."""

    def __init__(self):
        self._buf: Optional[mx.array] = None

    def get(self, n: int, blob_size: int) -> mx.array:
        nbytes = n * blob_size
        if nbytes > STAGING_KEEP_BYTES:
            return host_array((n, blob_size))
        if self._buf is None or self._buf.size < nbytes:
            self._buf = host_array((max(nbytes, 1),))
        return self._buf[:nbytes].reshape(n, blob_size)


class SlotPool:
    """``n_slots`` expert slots of one layout in MLX memory.

    "host" writes copy into the pool's memory through a host view (Metal, CPU); "device" writes
    go through host-resident staging and a GPU scatter (CUDA, see upload.py)."""

    def __init__(self, layout: ExpertLayout, n_slots: int, staging: Optional[DeviceStaging] = None):
        self.layout, self.n_slots = layout, n_slots
        self.raw = {c.name: mx.zeros((n_slots, c.nbytes), mx.uint8) for c in layout.components}
        mx.eval(list(self.raw.values()))
        self.staging = staging  # None: host writes
        self.device_writes = staging is not None
        self.host = None if self.device_writes else {n: host_view(a) for n, a in self.raw.items()}
        self._staged: Optional[mx.array] = None
        self._typed()

    def _typed(self) -> None:
        typed = {c.name: self.raw[c.name].view(MX_DTYPES[c.dtype]).reshape(self.n_slots, *c.shape)
                 for c in self.layout.components}
        if not self.device_writes:
            mx.eval(list(typed.values()))  # views share raw's buffers, written from the host
        self.pool = ExpertPool(typed, self.layout.quantization, self.layout.overrides)

    @property
    def nbytes(self) -> int:
        return self.n_slots * sum(c.nbytes for c in self.layout.components)

    def read_buffer(self, n: int) -> Optional[np.ndarray]:
        """Where to read ``n`` blobs for the next ``write`` (None: the reader's own buffer)."""
        if not self.device_writes:
            return None
        self._staged = self.staging.get(n, self.layout.blob_size)
        return host_view(self._staged)

    def write(self, slots: np.ndarray, blobs: np.ndarray, in_place: bool = False) -> None:
        """Copy ``blobs`` ``[n, blob_size]`` into ``slots``. ``in_place``: into these very
        buffers even while pending graphs hold them (a device-side table layer: its pending
        lookups pick slots when they run, see write_cuda.cuh)."""
        if not self.device_writes:
            for c in self.layout.components:
                self.host[c.name][slots] = blobs[:, c.offset:c.offset + c.nbytes]
            return
        n = len(slots)
        src = self._staged
        if src is None or src.shape[0] != n or host_view(src).ctypes.data != blobs.ctypes.data:
            self.read_buffer(n)
            src = self._staged
            host_view(src)[:] = blobs
        self._staged = None
        if in_place:  # enqueued now; the next layer's sync orders it before the staging's reuse
            mx.async_eval(device_table.write_in_place(src, slots, self.raw, self.layout))
            return
        idx = mx.array(slots.astype(np.uint32))
        self.pool = None  # drop the old typed views so the scatters can update in place
        for c in self.layout.components:
            arr = self.raw[c.name]
            arr[idx] = src[:, c.offset:c.offset + c.nbytes]
        self._typed()


def _read(store: ExpertStore, layer: int, experts: np.ndarray, stats: LayerStats,
          out: Optional[np.ndarray] = None) -> np.ndarray:
    t0 = time.perf_counter()
    blobs = store.read(layer, experts, out)
    stats.io_s += time.perf_counter() - t0
    stats.experts_read += len(experts)
    stats.bytes_read += blobs.nbytes
    return blobs


def _write(pool: SlotPool, slots: np.ndarray, blobs: np.ndarray, stats: LayerStats,
           in_place: bool = False) -> None:
    t0 = time.perf_counter()
    pool.write(slots, blobs, in_place)
    stats.upload_s += time.perf_counter() - t0


class StagingCache:
    """No residency: each call reads the routed experts into slots ``0..n-1``.

    One pool per layout serves every layer (a layer's reads finish before the next layer
    writes); a call needing more than ``STAGING_KEEP_BYTES`` of slots (prefill) gets a pool of
    its own that is not kept."""

    name = "staging"

    def __init__(self, store: ExpertStore, staging: Optional[DeviceStaging] = None):
        self.store = store
        self.staging = staging if staging is not None else (
            DeviceStaging() if device_slot_writes() else None)
        self.pools: Dict[str, SlotPool] = {}  # by layout: layers of one shape share a pool
        self._keys: Dict[int, str] = {}

    def resident_pool(self, layer: int) -> Optional[ExpertPool]:
        return None

    def absent(self, layer: int, experts: np.ndarray) -> np.ndarray:
        return experts

    def can_resolve(self, layer: int, indices: mx.array) -> bool:
        return False  # nothing stays resident to look up: every call syncs and reads

    def check(self) -> None:
        pass

    def settle(self, stats: Stats) -> None:
        pass

    def _pool(self, layer: int, n: int) -> SlotPool:
        layout = self.store.layout(layer)
        if n * layout.blob_size > STAGING_KEEP_BYTES:
            return SlotPool(layout, n, self.staging)
        key = self._keys.get(layer)
        if key is None:
            key = self._keys[layer] = json.dumps(layout.to_dict(), sort_keys=True)
        pool = self.pools.get(key)
        if pool is None or pool.n_slots < n:
            pool = self.pools[key] = SlotPool(layout, n, self.staging)
        return pool

    def fetch(self, layer: int, experts: np.ndarray, stats: LayerStats) -> Tuple[np.ndarray, ExpertPool]:
        """Make ``experts`` (sorted, unique) resident; return their slots and the pool."""
        pool = self._pool(layer, len(experts))
        slots = np.arange(len(experts))
        blobs = _read(self.store, layer, experts, stats, pool.read_buffer(len(experts)))
        _write(pool, slots, blobs, stats)
        stats.experts_missed += len(experts)
        return slots.astype(np.uint32), pool.pool

    def close(self) -> None:
        self.pools.clear()


class ExpertCache:
    """Slot pools under a byte budget, split over layers by their size; LRU eviction.

    With ``use_table`` (CUDA, see device_table.py), decode calls on partially cached layers
    look their slots up on the GPU and only the GPU waits, on misses, for the miss server
    process, which owns those layers' LRU; their synced calls ask it to admit experts.
    ``use_table="all"`` puts fully cached layers in the table too (filled whole at first use):
    the benchmark's measure of what the lookup itself costs. ``table_prefetch``: the GPU
    publishes the next table layer's predicted experts (``hint``) and the server reads the
    absent ones ahead."""

    name = "lru"

    def __init__(self, store: ExpertStore, layout: ModelLayout, budget_bytes: int,
                 use_table=False, table_prefetch: bool = False):
        self.store = store
        self.budget_bytes = budget_bytes
        total = layout.total_expert_bytes
        self.n_slots: Dict[int, int] = {}
        for i, lay in layout.layers.items():
            share = budget_bytes * lay.layer_bytes / total if total else 0
            self.n_slots[i] = int(min(lay.num_experts, share // lay.blob_size))
        self.pools: Dict[int, SlotPool] = {}  # allocated on a layer's first use
        self.lru: Dict[int, SlotLRU] = {}  # layers without the table
        self.resident: Dict[int, ExpertPool] = {}
        self.staging = DeviceStaging() if device_slot_writes() else None
        self.overflow = StagingCache(store, self.staging)
        self.control = None
        self.server: Optional[device_table.MissServer] = None
        self._streams: list = []  # streams table calls were enqueued on (mlx-lm uses its own)
        self._last_table_out: Optional[mx.array] = None  # see table_call_done
        partial = {i: (layout.layers[i].num_experts, n) for i, n in self.n_slots.items()
                   if 0 < n < layout.layers[i].num_experts
                   or (use_table == "all" and n == layout.layers[i].num_experts)}
        if use_table and partial:
            self.control = device_table.make_control(partial)
            try:  # the server opens the same expert files (a prefetcher reads like the store)
                self.server = device_table.MissServer(self.control, getattr(store, "store", store),
                                                      prefetch=table_prefetch)
            except BaseException:
                self.control.close()
                raise

    @property
    def capacity_bytes(self) -> int:
        return sum(n * self.store.layout(i).blob_size for i, n in self.n_slots.items())

    def resident_pool(self, layer: int) -> Optional[ExpertPool]:
        return self.resident.get(layer)

    def _table(self, layer: int):
        return self.control.layers.get(layer) if self.control is not None else None

    def slot_of(self, layer: int) -> Optional[np.ndarray]:
        """expert -> slot (-1: absent) of a partially cached layer, once it was used."""
        t = self._table(layer)
        if t is not None:
            return t.slot_of
        lru = self.lru.get(layer)
        return None if lru is None else lru.slot_of

    def absent(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Those of ``experts`` a fetch would have to read."""
        if layer in self.resident:
            return experts[:0]
        slot_of = self.slot_of(layer)
        return experts if slot_of is None else experts[slot_of[experts] < 0]

    def _pool(self, layer: int) -> SlotPool:
        pool = self.pools.get(layer)
        if pool is None:
            n_slots, layout = self.n_slots[layer], self.store.layout(layer)
            pool = self.pools[layer] = SlotPool(layout, n_slots, self.staging)
            if self._table(layer) is None and n_slots < layout.num_experts:
                self.lru[layer] = SlotLRU(layout.num_experts, n_slots)
        return pool

    def fetch(self, layer: int, experts: np.ndarray, stats: LayerStats) -> Tuple[np.ndarray, ExpertPool]:
        n_slots, layout = self.n_slots[layer], self.store.layout(layer)
        if len(experts) > n_slots:
            # more experts than slots (a long prefill on a small budget): stage them uncached
            return self.overflow.fetch(layer, experts, stats)
        pool = self._pool(layer)
        table = self._table(layer)
        if n_slots == layout.num_experts and table is None:
            self._fill_layer(layer, pool, stats)
            stats.experts_missed += len(experts)
            return experts.astype(np.uint32), pool.pool
        if table is not None:
            # A table call already submitted but not yet run would look slots up after the
            # admission below and read them before its writes: let it finish first. (Calls built
            # but not submitted run after the writes, which are in place: see write_cuda.cuh.)
            self.synchronize()
            # a fully cached table layer ("all") is filled whole, like a resident layer
            admit = np.arange(layout.num_experts) if n_slots == layout.num_experts else experts
            missing, victims = self.server.host_request(layer, HOST_ADMIT, admit)
        else:
            lru = self.lru[layer]
            lru.clock[0] += 1
            missing, victims = lru.admit(experts, int(lru.clock[0]))
        if missing.size:
            try:
                blobs = _read(self.store, layer, missing, stats, pool.read_buffer(missing.size))
                _write(pool, victims, blobs, stats, in_place=table is not None)
            except BaseException:  # the victims were freed: nothing claims bytes that never came
                if table is not None:
                    self.server.host_request(layer, HOST_RELEASE, missing)
                raise
            if table is None:
                lru.assign(missing, victims, int(lru.clock[0]))
            stats.experts_missed += missing.size
        return self.slot_of(layer)[experts].astype(np.uint32), pool.pool

    # -- the device-side table (decode on CUDA) ---------------------------------------------

    def can_resolve(self, layer: int, indices: mx.array) -> bool:
        if self._table(layer) is None:
            return False
        return indices.size == indices.shape[-1] and device_table.fits(indices.size, self.n_slots[layer])

    def can_hint(self, layer: int) -> bool:
        return self.server is not None and self.server.prefetch and self._table(layer) is not None

    def hint(self, layer: int, indices: mx.array, predicted: mx.array) -> mx.array:
        """``indices`` passed on (lazy) once the GPU has published ``predicted``, the experts
        table layer ``layer`` (the next one) is predicted to route to, for the server to read."""
        staging = self.server.staging_for(self.store.layout(layer).blob_size,
                                          device_table.staging_rows(indices.shape[-1]))
        return device_table.hint(self.control, staging, layer, indices, predicted)

    def table_call_done(self, out: mx.array) -> None:
        """``out``, the expert computation of the table call just built: the next one's lookup
        runs after it (see device_table.resolve)."""
        self._last_table_out = out

    def resolve(self, layer: int, indices: mx.array, stats: LayerStats) -> Tuple[mx.array, ExpertPool]:
        """Lazy slots of one token's experts; the GPU waits for the miss server on misses."""
        pool = self._pool(layer)
        layout = pool.layout
        stream = mx.default_stream(mx.default_device())
        if stream not in self._streams:
            self._streams.append(stream)
        staging = self.server.staging_for(layout.blob_size,
                                          device_table.staging_rows(indices.shape[-1]))
        slots = device_table.resolve(self.control, staging, layer, indices, pool.raw, layout,
                                     after=self._last_table_out)
        self.server.enqueued(layer)
        return slots, pool.pool

    def check(self) -> None:
        """Raise what the miss server or the GPU ran into since the last call."""
        if self.server is not None:
            self.server.check()

    def synchronize(self) -> None:
        """Wait for every enqueued table call, on whichever stream it was enqueued."""
        for stream in self._streams:
            mx.synchronize(stream)
        mx.synchronize()

    def settle(self, stats: Stats) -> None:
        """Wait for enqueued work, then count the misses the server read for it in ``stats``."""
        if self.server is not None:
            self.synchronize()
            self.server.fold_stats(stats.layer)

    def _fill_layer(self, layer: int, pool: SlotPool, stats: LayerStats) -> None:
        """Read the whole layer once, in bounded chunks; afterwards slot == expert id."""
        n = pool.layout.num_experts
        step = max(1, FILL_CHUNK_BYTES // pool.layout.blob_size)
        for e0 in range(0, n, step):
            experts = np.arange(e0, min(e0 + step, n))
            blobs = _read(self.store, layer, experts, stats, pool.read_buffer(len(experts)))
            _write(pool, experts, blobs, stats)
            if pool.device_writes:
                mx.eval(list(pool.raw.values()))  # before the staging buffer is reused
        self.resident[layer] = pool.pool

    def close(self) -> None:
        self._last_table_out = None
        if self.server is not None:
            try:
                self.synchronize()  # a GPU wait still enqueued is answered before the server stops
            finally:
                self.server.close()
        self.pools.clear()
        self.resident.clear()
        self.overflow.close()


_SIZE = re.compile(r"^\s*([\d.]+)\s*([kmgt]?i?b?)?\s*$", re.I)


def parse_budget(budget, total_expert_bytes: int) -> int:
    """Bytes from ``8GB`` / ``512MiB`` (binary units) / a number of bytes / a fraction of RAM
    (a float in (0, 1]) / ``"all"`` (every expert). ``None``: all experts when they fit in
    0.4 x RAM, else 0.4 x RAM."""
    ram = psutil.virtual_memory().total
    if budget is None:
        return int(min(total_expert_bytes, DEFAULT_RAM_FRACTION * ram))
    if isinstance(budget, str):
        if budget.strip().lower() == "all":
            return total_expert_bytes
        m = _SIZE.match(budget)
        if not m:
            raise ValueError(f"cache budget {budget!r}: expected e.g. 8GB, 512MiB, 0.25 or all")
        unit = (m[2] or "").lower().rstrip("b").rstrip("i")
        if unit:
            return int(float(m[1]) * 1024 ** " kmgt".index(unit))
        budget = float(m[1]) if "." in m[1] else int(m[1])
    if budget < 0:
        raise ValueError(f"cache budget {budget!r} is negative")
    if isinstance(budget, float) and budget <= 1:
        return int(budget * ram)
    return int(budget)


def make_cache(store: ExpertStore, layout: ModelLayout, budget=None,
               device_table_enabled=None, prefetch: bool = False):
    budget_bytes = parse_budget(budget, layout.total_expert_bytes)
    table = device_table.enabled(device_table_enabled)
    if table and device_table_enabled == "all":
        table = "all"
    cache = ExpertCache(store, layout, budget_bytes, table, prefetch) if budget_bytes > 0 else None
    if cache is None or cache.capacity_bytes == 0:
        return StagingCache(store)
    log.info("expert cache: %.2f GB budget, %.2f GB in slots (%.0f%% of the experts)",
             budget_bytes / 1e9, cache.capacity_bytes / 1e9,
             100 * cache.capacity_bytes / max(layout.total_expert_bytes, 1))
    return cache
