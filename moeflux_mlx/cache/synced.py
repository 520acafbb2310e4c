"""The host-synced lookup: one host sync per call tells which experts were routed; the cache
makes them resident and hands their slots to the computation.

Writing a slot that a not-yet-evaluated computation still reads would change that computation's
answer. So every computation that reads a writable pool is enqueued at once
(``computed`` -> ``mx.async_eval``), and writes only follow a host sync on work enqueued later on
the same in-order stream: a pool never changes under a pending read.
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from ..io.prefetch import Prefetcher
from ..io.store import ExpertStore
from ..stats import LayerStats, Stats
from .pool import ExpertPool
from .protocol import Predictor

MAX_PREDICT_TOKENS = 4  # prediction pays off in decode; a prefill needs most experts anyway


class HostSyncCache:
    """Base of the caches answered by a host sync per call (``fetch``), except for layers whose
    every expert is resident (``resident_pool``): their router indices are the slots.

    ``prefetcher``: reads go through it, and with a ``predictor`` the next layer's predicted
    experts that are absent are read ahead in the background."""

    name = "?"

    def __init__(self, store: ExpertStore, prefetcher: Optional[Prefetcher] = None):
        self.store = store
        self.prefetcher = prefetcher
        self.reader = prefetcher if prefetcher is not None else store
        self.predictor: Optional[Predictor] = None
        self._synced = False  # whether the last lookup wrote a writable pool

    # -- what subclasses provide --------------------------------------------------------------

    def resident_pool(self, layer: int) -> Optional[ExpertPool]:
        """The pool of a layer whose every expert is resident with slot == expert id."""
        return None

    def fetch(
        self, layer: int, experts: np.ndarray, stats: LayerStats
    ) -> Tuple[np.ndarray, ExpertPool]:
        """Make ``experts`` (sorted, unique) resident; return their slots and the pool."""
        raise NotImplementedError

    def absent(self, layer: int, experts: np.ndarray) -> np.ndarray:
        return experts

    # -- the protocol ---------------------------------------------------------------------------

    def lookup(
        self, layer: int, x: mx.array, indices: mx.array, stats: LayerStats
    ) -> Tuple[mx.array, ExpertPool]:
        resident = self.resident_pool(layer)
        if resident is not None:  # every expert resident, slot == expert id: no host sync
            self._synced = False
            stats.calls += 1
            stats.unsynced_calls += 1
            stats.tokens += indices.size // indices.shape[-1]  # the shape needs no sync
            return indices, resident
        return self.synced_lookup(layer, x, indices, stats)

    def synced_lookup(
        self, layer: int, x: mx.array, indices: mx.array, stats: LayerStats
    ) -> Tuple[mx.array, ExpertPool]:
        t0 = time.perf_counter()
        ahead = None
        if (
            self.prefetcher is not None
            and self.predictor is not None
            and indices.size // indices.shape[-1] <= MAX_PREDICT_TOKENS
        ):
            ahead = self.predictor(layer, x, indices.shape[-1])
            if ahead is not None:
                mx.eval(indices, ahead[1])  # one sync for both
        idx = np.array(indices)  # the one host sync per MoE layer: which experts were routed
        t1 = time.perf_counter()
        experts, inverse = np.unique(idx, return_inverse=True)
        self.store.check_experts(layer, experts)
        slot_of, pool = self.fetch(layer, experts, stats)
        if ahead is not None and self.prefetcher is not None:
            nxt = ahead[0]
            self.prefetcher.submit(nxt, self.absent(nxt, np.unique(np.array(ahead[1]))))
        self._synced = True
        stats.calls += 1
        stats.tokens += int(np.prod(idx.shape[:-1]))
        stats.experts_routed += len(experts)
        stats.sync_s += t1 - t0
        return mx.array(slot_of[inverse].reshape(idx.shape)), pool

    def computed(self, out: mx.array) -> None:
        if self._synced:
            mx.async_eval(out)  # the pool's next write must not overtake this read

    def check(self) -> None:
        pass

    def settle(self, stats: Stats) -> None:
        pass

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
