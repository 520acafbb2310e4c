"""Where routed experts live in MLX memory between reads: a pool of slots per layer.

``StagingCache`` keeps nothing between calls: each call reads the routed experts, uploads them
as one array and computes on that (slot i = the i-th routed expert)."""

from __future__ import annotations

import time
from typing import Tuple

import mlx.core as mx
import numpy as np

from .backends import ExpertPool
from .stats import LayerStats
from .store import ExpertStore


class StagingCache:
    name = "staging"

    def __init__(self, store: ExpertStore):
        self.store = store

    def fetch(self, layer: int, experts: np.ndarray, stats: LayerStats) -> Tuple[np.ndarray, ExpertPool]:
        """Make ``experts`` (sorted, unique) resident; return their slots and the pool."""
        t0 = time.perf_counter()
        blobs = self.store.read(layer, experts)
        t1 = time.perf_counter()
        pool = ExpertPool.from_blobs(mx.array(blobs), self.store.layout(layer))
        stats.io_s += t1 - t0
        stats.upload_s += time.perf_counter() - t1
        stats.experts_read += len(experts)
        stats.bytes_read += blobs.nbytes
        return np.arange(len(experts), dtype=np.uint32), pool

    def close(self) -> None:
        pass
