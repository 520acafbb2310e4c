"""``StagingCache``: no residency. Every call reads the routed experts into slots ``0..n-1``."""

from __future__ import annotations

import json
from typing import Dict, Optional, Tuple

import numpy as np

from ..io.prefetch import Prefetcher
from ..io.store import ExpertStore
from ..stats import LayerStats
from .pool import STAGING_KEEP_BYTES, DeviceStaging, ExpertPool, SlotPool, read_blobs, write_blobs
from .synced import HostSyncCache


class StagingCache(HostSyncCache):
    """No residency: each call reads the routed experts into slots ``0..n-1``.

    One pool per layout serves every layer (a layer's reads finish before the next layer
    writes); a call needing more than ``STAGING_KEEP_BYTES`` of slots (prefill) gets a pool of
    its own that is not kept. ``staging``: device slot writes (CUDA), else host writes.
    ``prefill_whole_layer``: see ``HostSyncCache`` (a prefill reads its whole layer unsynced)."""

    name = "staging"

    def __init__(
        self,
        store: ExpertStore,
        staging: Optional[DeviceStaging] = None,
        prefetcher: Optional[Prefetcher] = None,
        prefill_whole_layer: Optional[float] = None,
    ):
        super().__init__(store, prefetcher, prefill_whole_layer, staging)
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
        self, layer: int, experts: np.ndarray, stats: LayerStats
    ) -> Tuple[np.ndarray, ExpertPool]:
        pool = self._pool(layer, len(experts))
        slots = np.arange(len(experts))
        blobs = read_blobs(self.reader, layer, experts, stats, pool.read_buffer(len(experts)))
        write_blobs(pool, slots, blobs, stats)
        stats.experts_missed += len(experts)
        return slots.astype(np.uint32), pool.pool

    def close(self) -> None:
        super().close()
        self.pools.clear()
