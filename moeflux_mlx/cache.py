"""Where routed experts live in MLX memory between reads: a pool of slots per layer.

``StagingCache`` keeps nothing between calls: each call reads the routed experts, uploads them
as one array and computes on that (slot i = the i-th routed expert).

``ExpertCache`` keeps a pool of slots per layer under a byte budget (LRU eviction). A layer whose
budget holds all its experts is filled once, on first use, with slot = expert id; from then on
its router indices go to the kernels as they are, with no host sync at all.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np
import psutil

from .backends import MX_DTYPES, ExpertPool
from .layout import ExpertLayout, ModelLayout
from .stats import LayerStats
from .store import ExpertStore

log = logging.getLogger(__name__)

DEFAULT_RAM_FRACTION = 0.4  # of physical RAM, when no budget is given and the experts do not fit


def _upload(blobs: np.ndarray) -> mx.array:
    return mx.array(blobs)


class StagingCache:
    name = "staging"

    def __init__(self, store: ExpertStore):
        self.store = store

    def resident_pool(self, layer: int) -> Optional[ExpertPool]:
        return None

    def fetch(self, layer: int, experts: np.ndarray, stats: LayerStats) -> Tuple[np.ndarray, ExpertPool]:
        """Make ``experts`` (sorted, unique) resident; return their slots and the pool."""
        t0 = time.perf_counter()
        blobs = self.store.read(layer, experts)
        t1 = time.perf_counter()
        pool = ExpertPool.from_blobs(_upload(blobs), self.store.layout(layer))
        stats.io_s += t1 - t0
        stats.upload_s += time.perf_counter() - t1
        stats.experts_missed += len(experts)
        stats.experts_read += len(experts)
        stats.bytes_read += blobs.nbytes
        return np.arange(len(experts), dtype=np.uint32), pool

    def close(self) -> None:
        pass


class _LayerSlots:
    """One layer's slot pool: typed arrays ``[n_slots, *shape]`` and the LRU bookkeeping."""

    def __init__(self, layout: ExpertLayout, n_slots: int):
        self.layout = layout
        self.n_slots = n_slots
        self.slot_of = np.full(layout.num_experts, -1, np.int64)  # expert -> slot
        self.expert_in = np.full(n_slots, -1, np.int64)  # slot -> expert
        self.last_used = np.full(n_slots, -1, np.int64)  # -1: free
        self.arrays: Optional[Dict[str, mx.array]] = None
        self.resident = False  # every expert is in its own slot (slot == expert id)

    def pool(self) -> ExpertPool:
        return ExpertPool(self.arrays, self.layout.quantization, self.layout.overrides)

    def write(self, slots: np.ndarray, blobs: mx.array) -> None:
        new = ExpertPool.from_blobs(blobs, self.layout).arrays
        if self.arrays is None:
            self.arrays = {c.name: mx.zeros((self.n_slots, *c.shape), MX_DTYPES[c.dtype])
                           for c in self.layout.components}
        idx = mx.array(slots.astype(np.uint32))
        for name, arr in self.arrays.items():
            arr[idx] = new[name]  # in place: MLX donates the pool's buffer to the scatter


class ExpertCache:
    """Slot pools under a byte budget, split over layers by their size; LRU eviction."""

    name = "lru"

    def __init__(self, store: ExpertStore, layout: ModelLayout, budget_bytes: int):
        self.store = store
        self.budget_bytes = budget_bytes
        total = layout.total_expert_bytes
        self.layers: Dict[int, _LayerSlots] = {}
        for i, lay in layout.layers.items():
            share = budget_bytes * lay.layer_bytes / total if total else 0
            n = int(min(lay.num_experts, share // lay.blob_size))
            self.layers[i] = _LayerSlots(lay, n)
        self.tick = 0

    @property
    def capacity_bytes(self) -> int:
        return sum(s.n_slots * s.layout.blob_size for s in self.layers.values())

    def resident_pool(self, layer: int) -> Optional[ExpertPool]:
        s = self.layers[layer]
        return s.pool() if s.resident else None

    def fetch(self, layer: int, experts: np.ndarray, stats: LayerStats) -> Tuple[np.ndarray, ExpertPool]:
        s = self.layers[layer]
        if s.n_slots == s.layout.num_experts:
            self._fill_layer(layer, s, stats)
            stats.experts_missed += len(experts)
            return experts.astype(np.uint32), s.pool()
        if len(experts) > s.n_slots:
            # more experts than slots (a long prefill on a small budget): stage them uncached
            return StagingCache(self.store).fetch(layer, experts, stats)
        self.tick += 1
        slots = s.slot_of[experts]
        hit = slots >= 0
        s.last_used[slots[hit]] = self.tick
        missing = experts[~hit]
        if missing.size:
            t0 = time.perf_counter()
            blobs = self.store.read(layer, missing)
            t1 = time.perf_counter()
            # victims: free slots first, then the least recently used not needed now
            victims = np.argpartition(s.last_used, missing.size - 1)[:missing.size]
            old = s.expert_in[victims]
            s.slot_of[old[old >= 0]] = -1
            s.slot_of[missing] = victims
            s.expert_in[victims] = missing
            s.last_used[victims] = self.tick
            s.write(victims, _upload(blobs))
            slots = s.slot_of[experts]
            stats.io_s += t1 - t0
            stats.upload_s += time.perf_counter() - t1
            stats.experts_missed += missing.size
            stats.experts_read += missing.size
            stats.bytes_read += blobs.nbytes
        return slots.astype(np.uint32), s.pool()

    def _fill_layer(self, layer: int, s: _LayerSlots, stats: LayerStats) -> None:
        """Read the whole layer once, in bounded chunks; afterwards slot == expert id."""
        t0 = time.perf_counter()
        io = 0.0
        step = max(1, (64 << 20) // s.layout.blob_size)
        for e0 in range(0, s.layout.num_experts, step):
            experts = np.arange(e0, min(e0 + step, s.layout.num_experts))
            t = time.perf_counter()
            blobs = self.store.read(layer, experts)
            io += time.perf_counter() - t
            s.write(experts, _upload(blobs))
            mx.eval(list(s.arrays.values()))
        s.slot_of[:] = np.arange(s.layout.num_experts)
        s.expert_in[:] = s.slot_of
        s.resident = True
        stats.io_s += io
        stats.upload_s += time.perf_counter() - t0 - io
        stats.experts_read += s.layout.num_experts
        stats.bytes_read += s.layout.layer_bytes

    def close(self) -> None:
        for s in self.layers.values():
            s.arrays = None
            s.resident = False


_SIZE = re.compile(r"^\s*([\d.]+)\s*([kmgt]?i?b?)?\s*$", re.I)


def parse_budget(budget, total_expert_bytes: int) -> int:
    """Bytes from ``8GB`` / ``512MiB`` / a number of bytes / a fraction of RAM (0 < x <= 1) /
    ``"all"`` (every expert); ``None``: all experts when they fit in 0.4 x RAM, else 0.4 x RAM."""
    ram = psutil.virtual_memory().total
    if budget is None:
        return int(min(total_expert_bytes, DEFAULT_RAM_FRACTION * ram))
    if isinstance(budget, str):
        if budget.strip().lower() == "all":
            return total_expert_bytes
        m = _SIZE.match(budget)
        if not m:
            raise ValueError(f"cache budget {budget!r}: expected e.g. 8GB, 512MiB, 0.25 or all")
        value, unit = float(m[1]), (m[2] or "").lower().rstrip("b").rstrip("i")
        if not unit:
            budget = value
        else:
            return int(value * 1024 ** " kmgt".index(unit))
    if 0 <= budget <= 1 and isinstance(budget, float):
        return int(budget * ram)
    if budget < 0:
        raise ValueError(f"cache budget {budget!r} is negative")
    return int(budget)


def make_cache(store: ExpertStore, layout: ModelLayout, budget=None):
    budget_bytes = parse_budget(budget, layout.total_expert_bytes)
    if budget_bytes <= 0:
        return StagingCache(store)
    cache = ExpertCache(store, layout, budget_bytes)
    if cache.capacity_bytes == 0:
        return StagingCache(store)
    log.info("expert cache: %.2f GB budget, %.2f GB in slots (%.0f%% of the experts)",
             budget_bytes / 1e9, cache.capacity_bytes / 1e9,
             100 * cache.capacity_bytes / max(layout.total_expert_bytes, 1))
    return cache
