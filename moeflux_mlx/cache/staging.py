"""``StagingCache``: no residency. Every call reads the routed experts into slots ``0..n-1``."""

from __future__ import annotations

import json
import time
from typing import Dict, Optional, Tuple

import numpy as np

from ..io.prefetch import Prefetcher
from ..io.store import ExpertStore
from ..stats import LayerStats
from .pool import (
    STAGING_KEEP_BYTES,
    DeviceStaging,
    ExpertPool,
    SlotPool,
    copy_slots,
    read_blobs,
    write_blobs,
)
from .synced import HostSyncCache


class StagingCache(HostSyncCache):
    """No residency: each call reads the routed experts into slots ``0..n-1``.

    One pool per layout serves every layer (a layer's reads finish before the next layer
    writes); a call needing more than ``STAGING_KEEP_BYTES`` of slots (prefill) gets a pool of
    its own that is not kept. ``staging``: device slot writes (CUDA), else host writes.
    ``prefill_whole_layer``, ``prefill_read_ahead``: see ``HostSyncCache`` (a prefill reads
    its whole layers unsynced, the next one ahead)."""

    name = "staging"

    def __init__(
        self,
        store: ExpertStore,
        staging: Optional[DeviceStaging] = None,
        prefetcher: Optional[Prefetcher] = None,
        prefill_whole_layer: Optional[float] = None,
        prefill_read_ahead: bool = True,
    ):
        super().__init__(store, prefetcher, prefill_whole_layer, staging, prefill_read_ahead)
        self.pools: Dict[str, SlotPool] = {}  # by layout: layers of one shape share a pool
        self._keys: Dict[int, str] = {}

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

    def fetch(
        self,
        layer: int,
        experts: np.ndarray,
        stats: LayerStats,
        resident: Optional[Tuple[SlotPool, np.ndarray]] = None,
    ) -> Tuple[np.ndarray, ExpertPool]:
        """``experts`` into slots ``0..n-1``. ``resident``: ``(pool, slot per expert, -1 where
        absent)`` of a cache that holds some of them: those are copied from its slots, and only
        the others are read."""
        pool = self._pool(layer, len(experts))
        slots = np.arange(len(experts))
        held = np.zeros(len(experts), bool) if resident is None else resident[1] >= 0
        missing = experts[~held]
        if missing.size:
            buf = pool.read_buffer(missing.size)
            blobs = read_blobs(self.reader, layer, missing, stats, buf)
            write_blobs(pool, slots[~held], blobs, stats)
        if held.any():
            assert resident is not None
            t0 = time.perf_counter()
            copy_slots(pool, slots[held], resident[0], resident[1][held])
            stats.upload_s += time.perf_counter() - t0
        stats.experts_missed += missing.size
        return slots.astype(np.uint32), pool.pool

    def close(self) -> None:
        super().close()
        self.pools.clear()
