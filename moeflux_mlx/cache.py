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

import contextlib
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
from .errors import ExpertReadError
from .layout import ExpertLayout, ModelLayout
from .stats import LayerStats
from .store import ExpertStore  # or a prefetch.Prefetcher, which reads like one
from .upload import device_slot_writes, host_array, host_view

log = logging.getLogger(__name__)
_NO_LOCK = contextlib.nullcontext()

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

    def write(self, slots: np.ndarray, blobs: np.ndarray) -> None:
        """Copy ``blobs`` ``[n, blob_size]`` into ``slots``."""
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


def _write(pool: SlotPool, slots: np.ndarray, blobs: np.ndarray, stats: LayerStats) -> None:
    t0 = time.perf_counter()
    pool.write(slots, blobs)
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

    def settle(self) -> None:
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


class _LRU:
    """Slot bookkeeping of one layer. With the device-side table, ``slot_of``, ``last_used``
    and the clock are views into its control block, shared with the GPU."""

    def __init__(self, num_experts: int, n_slots: int, table=None, clock: Optional[np.ndarray] = None):
        self.slot_of = table.slot_of if table is not None else np.full(num_experts, -1, np.int64)
        self.last_used = table.last_used if table is not None else np.full(n_slots, -1, np.int64)
        self.expert_in = np.full(n_slots, -1, np.int64)  # slot -> expert (only the host needs it)
        self.clock = clock if clock is not None else np.zeros(1, np.int64)  # one tick per call

    def admit(self, experts: np.ndarray, tick: int) -> Tuple[np.ndarray, np.ndarray]:
        """Mark the resident ones used; pick and free a victim slot for each missing one (free
        slots first, then the least recently used not needed now). Returns (missing, victims).

        Victims are freed before their new bytes are written: an interrupted write must not
        leave a slot that claims an expert whose bytes never arrived."""
        slots = self.slot_of[experts]
        hit = slots >= 0
        self.last_used[slots[hit]] = tick
        missing = experts[~hit]
        if not missing.size:
            return missing, slots[:0]
        victims = np.argpartition(self.last_used, missing.size - 1)[:missing.size]
        old = self.expert_in[victims]
        self.slot_of[old[old >= 0]] = -1
        self.expert_in[victims] = -1
        self.last_used[victims] = -1
        return missing, victims

    def assign(self, missing: np.ndarray, victims: np.ndarray, tick: int) -> None:
        self.slot_of[missing] = victims
        self.expert_in[victims] = missing
        self.last_used[victims] = tick

    def release(self, experts: np.ndarray) -> None:
        slots = self.slot_of[experts]
        slots = slots[slots >= 0]
        self.slot_of[experts] = -1
        self.expert_in[slots] = -1
        self.last_used[slots] = -1


class ExpertCache:
    """Slot pools under a byte budget, split over layers by their size; LRU eviction.

    With ``use_table`` (CUDA, see device_table.py), decode calls on partially cached layers
    look their slots up on the GPU and only the GPU waits, on misses; other calls sync."""

    name = "lru"

    def __init__(self, store: ExpertStore, layout: ModelLayout, budget_bytes: int,
                 use_table: bool = False):
        self.store = store
        self.budget_bytes = budget_bytes
        total = layout.total_expert_bytes
        self.n_slots: Dict[int, int] = {}
        for i, lay in layout.layers.items():
            share = budget_bytes * lay.layer_bytes / total if total else 0
            self.n_slots[i] = int(min(lay.num_experts, share // lay.blob_size))
        self.pools: Dict[int, SlotPool] = {}  # allocated on a layer's first use
        self.lru: Dict[int, _LRU] = {}
        self.resident: Dict[int, ExpertPool] = {}
        self.staging = DeviceStaging() if device_slot_writes() else None
        self.overflow = StagingCache(store, self.staging)
        self.control: Optional[device_table.ControlBlock] = None
        self.service: Optional[device_table.MissService] = None
        partial = {i: (layout.layers[i].num_experts, n) for i, n in self.n_slots.items()
                   if 0 < n < layout.layers[i].num_experts}
        if use_table and partial:
            self.control = device_table.ControlBlock(partial)
            self.service = device_table.MissService(self.control, self._serve)
        self._layer_stats: Dict[int, LayerStats] = {}
        self._poisoned: list = []  # (layer, experts) whose slots hold NaN bytes after a failed read

    @property
    def capacity_bytes(self) -> int:
        return sum(n * self.store.layout(i).blob_size for i, n in self.n_slots.items())

    def resident_pool(self, layer: int) -> Optional[ExpertPool]:
        return self.resident.get(layer)

    def absent(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Those of ``experts`` a fetch would have to read."""
        if layer in self.resident:
            return experts[:0]
        lru = self.lru.get(layer)
        return experts if lru is None else experts[lru.slot_of[experts] < 0]

    def _layer(self, layer: int) -> Tuple[SlotPool, _LRU]:
        pool = self.pools.get(layer)
        if pool is None:
            n_slots, layout = self.n_slots[layer], self.store.layout(layer)
            pool = self.pools[layer] = SlotPool(layout, n_slots, self.staging)
            table = self.control.layers.get(layer) if self.control is not None else None
            clock = self.control.ticks[table.index:table.index + 1] if table is not None else None
            self.lru[layer] = _LRU(layout.num_experts, n_slots, table, clock)
        return pool, self.lru[layer]

    def fetch(self, layer: int, experts: np.ndarray, stats: LayerStats) -> Tuple[np.ndarray, ExpertPool]:
        n_slots, layout = self.n_slots[layer], self.store.layout(layer)
        if len(experts) > n_slots:
            # more experts than slots (a long prefill on a small budget): stage them uncached
            return self.overflow.fetch(layer, experts, stats)
        pool, lru = self._layer(layer)
        if n_slots == layout.num_experts:
            self._fill_layer(layer, pool, stats)
            stats.experts_missed += len(experts)
            return experts.astype(np.uint32), pool.pool
        with self._table_lock():
            tick = self._tick(layer, lru)
            missing, victims = lru.admit(experts, tick)
            if missing.size:
                blobs = _read(self.store, layer, missing, stats, pool.read_buffer(missing.size))
                _write(pool, victims, blobs, stats)
                lru.assign(missing, victims, tick)
                stats.experts_missed += missing.size
            slots = lru.slot_of[experts]
        return slots.astype(np.uint32), pool.pool

    def _tick(self, layer: int, lru: _LRU) -> int:
        lru.clock[0] += 1
        if self.service is not None and layer in self.control.layers:
            self.service.enqueued(layer)  # a host-side call counts like a GPU one
        return int(lru.clock[0])

    def _table_lock(self):
        return self.service._lock if self.service is not None else _NO_LOCK

    # -- the device-side table (decode on CUDA) ---------------------------------------------

    def can_resolve(self, layer: int, indices: mx.array) -> bool:
        if self.control is None or layer not in self.control.layers:
            return False
        return indices.size == indices.shape[-1] and device_table.fits(indices.size, self.n_slots[layer])

    def resolve(self, layer: int, indices: mx.array, stats: LayerStats) -> Tuple[mx.array, ExpertPool]:
        """Lazy slots of one token's experts; misses are served while the GPU waits."""
        pool, _ = self._layer(layer)
        self._layer_stats[layer] = stats
        layout = pool.layout
        self.control.staging_for(layout.blob_size, device_table.staging_rows(indices.shape[-1]))
        slots = device_table.resolve(self.control, layer, indices, pool.raw, layout)
        self.service.enqueued(layer)
        return slots, pool.pool

    def _serve(self, layer: int, experts: np.ndarray) -> None:
        """The miss service's work for one request (runs on its thread, the GPU waiting)."""
        t = self.control.layers[layer]
        lru = self.lru[layer]
        stats = self._layer_stats[layer]
        tick = int(lru.clock[0]) + 1  # the waiting call's tick; the GPU stores it when done
        missing, victims = lru.admit(experts, tick)
        n = missing.size
        # plain numpy: the service thread never calls into MLX (an MLX call could wait on the
        # GPU, which may be waiting on this very thread)
        staging = self.control.staging[self.store.layout(layer).blob_size].array.reshape(
            -1, self.store.layout(layer).blob_size)
        if n > staging.shape[0]:
            raise ExpertReadError(f"layer {layer}: {n} missed experts in one call, staging "
                                  f"holds {staging.shape[0]}")
        try:
            t.header[device_table.H_ERR] = 0
            _read(self.store, layer, missing, stats, staging[:n])
            stats.experts_missed += n
        except BaseException:
            t.header[device_table.H_ERR] = 1  # fill writes NaN bytes into these slots
            self._poisoned.append((layer, missing))
            raise
        finally:
            lru.assign(missing, victims, tick)
            t.copy_src[:n] = np.arange(n)
            t.copy_dst[:n] = victims
            t.header[device_table.H_NCOPY] = n

    def check(self) -> None:
        """Serve pending misses from this thread, and raise what the service ran into."""
        if self.service is None:
            return
        self.service.poll()
        if self.service.errors or self._poisoned:
            with self._table_lock():
                poisoned, self._poisoned = self._poisoned, []
                for layer, experts in poisoned:
                    self.lru[layer].release(experts)
        self.service.check()

    def settle(self) -> None:
        """Wait for enqueued work, so that the counters include the misses it served."""
        if self.service is not None:
            mx.synchronize()

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
        if self.service is not None:
            self.service.close()
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
               device_table_enabled: Optional[bool] = None):
    budget_bytes = parse_budget(budget, layout.total_expert_bytes)
    table = device_table.enabled(device_table_enabled)
    cache = ExpertCache(store, layout, budget_bytes, table) if budget_bytes > 0 else None
    if cache is None or cache.capacity_bytes == 0:
        return StagingCache(store)
    log.info("expert cache: %.2f GB budget, %.2f GB in slots (%.0f%% of the experts)",
             budget_bytes / 1e9, cache.capacity_bytes / 1e9,
             100 * cache.capacity_bytes / max(layout.total_expert_bytes, 1))
    return cache
