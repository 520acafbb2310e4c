"""The host-synced lookup: one host sync per call tells which experts were routed; the cache
makes them resident and hands their slots to the computation.

Writing a slot that a not-yet-evaluated computation still reads would change that computation's
answer. So every computation that reads a writable pool is enqueued at once
(``computed`` -> ``mx.async_eval``), and writes only follow a host sync on work enqueued later on
the same in-order stream: a pool never changes under a pending read.

A call on a layer with fewer slots than experts that routes many rows per expert (a prefill at a
small budget: ``prefill_whole_layer``) skips the host sync instead: it reads the whole layer
into a pool of its own that nothing ever writes again, and its router indices are the slots.
The next layer's read starts at once, in the background (``whole_layer``).
The model's graph then stays lazy, as stock mlx-lm's: outputs nobody asks for (the last layer's,
in a prefill chunk) are never computed, where a host sync per layer and ``mx.async_eval`` of every
output forced them. Memory stays bounded: the next such call of the same forward pass starts the
previous layer's computation, reads its own layer meanwhile, and waits for the layer before
that, so at most two of these pools are alive and the device always has a layer queued; a call
on an earlier layer (a new forward pass) forgets the previous one without forcing it.
"""

from __future__ import annotations

import time
from typing import List, NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..io.prefetch import Prefetcher
from ..io.store import ExpertStore
from ..options import DEFAULT_PREFILL_WHOLE_LAYER
from ..stats import LayerStats, Stats
from .pool import DeviceStaging, ExpertPool
from .protocol import Predictor
from .whole_layer import WholeLayerReads

MAX_PREDICT_TOKENS = 4  # prediction pays off in decode; a prefill needs most experts anyway
# a whole-layer call's latest rows the eviction policy learns from (``observe_prefill``): the
# prompt's end is what the decode continues, and a learning policy's update costs per row
OBSERVE_ROWS = 128


class _WholeCall(NamedTuple):
    """A whole-layer call once its computation is built: what ``whole_lookup`` waits on and
    ``_whole_computed`` learns and copies from."""

    layer: int
    pool: ExpertPool
    indices: mx.array
    out: mx.array


class HostSyncCache:
    """Base of the caches answered by a host sync per call (``fetch``), except for layers whose
    every expert is resident (``resident_pool``): their router indices are the slots.

    ``prefetcher``: reads go through it, and with a ``predictor`` the next layer's predicted
    experts that are absent are read ahead in the background. ``prefill_whole_layer``: rows
    per expert from which a call on a layer with fewer slots than experts reads the whole layer
    without a host sync (``LoadOptions.prefill_whole_layer``, handed in by the runtime's cache
    factory; None: the default; 0: never); ``prefill_read_ahead``: the next such layer's read
    starts while this one computes (``LoadOptions.prefill_read_ahead``). ``staging``: device
    slot writes (CUDA), else host writes."""

    name = "?"
    prefill_warm_slots = False  # refill slots after a whole-layer call (caches with slots)
    prefill_learns = False  # the policy learns a whole-layer call's routing (caches with one)

    def __init__(
        self,
        store: ExpertStore,
        prefetcher: Optional[Prefetcher] = None,
        prefill_whole_layer: Optional[float] = None,
        staging: Optional[DeviceStaging] = None,
        prefill_read_ahead: bool = True,
    ):
        self.store = store
        self.prefetcher = prefetcher
        self.staging = staging
        self.reader = prefetcher if prefetcher is not None else store
        self.predictor: Optional[Predictor] = None
        self._synced = False  # whether the last lookup wrote a writable pool
        self.prefill_whole_layer = float(
            DEFAULT_PREFILL_WHOLE_LAYER if prefill_whole_layer is None else prefill_whole_layer
        )
        # the last lookup, if it read its layer whole: (layer, its pool, its router indices)
        self._whole: Optional[Tuple[int, ExpertPool, mx.array]] = None
        # that call once computed lazily (``_WholeCall``), not forced yet: see the module's
        # text; and the one before, queued, not yet waited for
        self._pending: Optional[_WholeCall] = None
        self._older: Optional[_WholeCall] = None
        self.whole_reads = WholeLayerReads(store, staging, prefill_read_ahead)
        self._read_whole: Optional[List[int]] = None  # layers with fewer slots than experts

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

    def slot_count(self, layer: int) -> int:
        """How many of the layer's experts can be resident at once (0: none)."""
        return 0

    def _next_whole(self, layer: int) -> Optional[int]:
        """The layer after ``layer`` that a prefill's forward pass reads whole next."""
        if self._read_whole is None:
            self._read_whole = [
                i
                for i in sorted(self.store.layers)
                if self.slot_count(i) < self.store.layout(i).num_experts
            ]
        return next((i for i in self._read_whole if i > layer), None)

    # -- the protocol ---------------------------------------------------------------------------

    def begin_call(self, layer: int) -> None:
        """Every lookup starts here (the device-side table's too): a call on the layer of the
        held whole-layer output or an earlier one starts a new forward pass, whose predecessor's
        unused output stays lazy and is let go (with its pool)."""
        self._whole = None
        if self._pending is not None and self._pending[0] >= layer:
            older, self._pending, self._older = self._older, None, None
            if older is not None:  # computed by the pass that ended (its output fed the next)
                self._whole_computed(older)

    def lookup(
        self, layer: int, x: mx.array, indices: mx.array, stats: LayerStats
    ) -> Tuple[mx.array, ExpertPool]:
        self.begin_call(layer)
        resident = self.resident_pool(layer)
        if resident is not None:  # every expert resident, slot == expert id: no host sync
            self._synced = False
            stats.calls += 1
            stats.unsynced_calls += 1
            stats.tokens += indices.size // indices.shape[-1]  # the shape needs no sync
            return indices, resident
        if self.reads_whole(layer, indices):
            return self.whole_lookup(layer, indices, stats)
        return self.synced_lookup(layer, x, indices, stats)

    def reads_whole(self, layer: int, indices: mx.array) -> bool:
        """Whether this call reads its whole layer without a host sync: the layer has fewer
        slots than experts, and the call routes ``prefill_whole_layer`` rows per expert or more
        (the shape needs no sync)."""
        if self.prefill_whole_layer <= 0:
            return False
        n = self.store.layout(layer).num_experts
        return self.slot_count(layer) < n and indices.size >= self.prefill_whole_layer * n

    def whole_lookup(
        self, layer: int, indices: mx.array, stats: LayerStats
    ) -> Tuple[mx.array, ExpertPool]:
        """Every expert of the layer in a pool of its own (slot == expert id): the router's
        indices go to the computation unchanged, with no host sync."""
        prev, self._pending = self._pending, None
        if prev is not None:
            mx.async_eval(prev.out)  # the previous layer computes while this one is read
        t0 = time.perf_counter()
        # Wait for the output of the layer before the previous one (its pool is freed then: with
        # the previous layer's and this one's, at most two such pools alive) and for the previous
        # layer's copies out of staging (CUDA), whose buffer the next read reuses. The previous
        # layer's computation stays queued, so the device works on while Python builds the next
        # layer (waiting for it here, the device sat idle meanwhile).
        older, self._older = self._older, prev
        mx.eval(
            ([] if older is None else [older.out])
            + ([] if prev is None else list(prev.pool.arrays.values()))
        )
        stats.sync_s += time.perf_counter() - t0  # waiting for the device
        if older is not None:
            self._whole_computed(older)
        pool = self.whole_reads.take(layer, stats)
        mx.async_eval(list(pool.arrays.values()))  # copies beside the previous layer's computation
        nxt = self._next_whole(layer)
        if nxt is not None:
            self.whole_reads.ahead(nxt)
        n = self.store.layout(layer).num_experts
        self._synced = False
        self._whole = (layer, pool, indices)
        stats.calls += 1
        stats.unsynced_calls += 1
        stats.tokens += indices.size // indices.shape[-1]  # the shape needs no sync
        # which were routed is not known without a sync: each expert read counts as routed+missed
        stats.experts_routed += n
        stats.experts_missed += n
        return indices, pool

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

    def _whole_computed(self, call: _WholeCall) -> None:
        """Once a whole-layer call has computed (its indices are in memory by then: no wait):
        the layer's eviction policy learns from its latest rows (``observe_prefill``), and its
        slots take the experts the call's rows routed most (``warm_slots``), copied from its
        pool, so the next calls of the layer (a prompt's last token, the first generated ones)
        find them without a read. With both off not even the indices are read back."""
        if not (self.prefill_warm_slots or self.prefill_learns):
            return
        n = self.slot_count(call.layer)
        num = self.store.layout(call.layer).num_experts
        if n <= 0 or n >= num:
            return
        rows = np.array(call.indices).reshape(-1, call.indices.shape[-1]).astype(np.int64)
        if self.prefill_learns:
            self.observe_prefill(call.layer, rows[-OBSERVE_ROWS:])
        if self.prefill_warm_slots:
            self._warm(call, rows.reshape(-1), n, num)

    def _warm(self, call: _WholeCall, idx: np.ndarray, n: int, num: int) -> None:
        """``warm_slots`` with the ``n`` experts of ``num`` that ``idx`` (the call's routing,
        flat) routed most."""
        counts = np.bincount(idx, minlength=num)
        last = np.zeros(num, np.int64)  # where each expert was routed last
        np.maximum.at(last, idx, np.arange(idx.size))
        order = np.lexsort((-last, -counts))  # most routed first; of equals, the latest
        experts = np.sort(order[: min(n, int(np.count_nonzero(counts)))])
        self.warm_slots(call.layer, experts, call.pool)

    def observe_prefill(self, layer: int, rows: np.ndarray) -> None:
        """The layer's eviction policy learns from ``rows`` (``[n, top_k]``, a whole-layer
        call's routing in token order), as from calls it did not serve: the slots stay as they
        are. Caches without a policy do nothing."""

    def warm_slots(self, layer: int, experts: np.ndarray, whole: ExpertPool) -> None:
        """Make ``experts`` (sorted, unique, at most the layer's slots) resident, copied from
        ``whole`` (a whole-layer pool: slot == expert id) rather than read; lazy on the device.
        Caches without slots do nothing."""

    def waves(
        self, layer: int, indices: mx.array, outside: bool = False
    ) -> Optional[List[mx.array]]:
        return None  # every call is looked up whole

    def computed(self, out: mx.array) -> None:
        if self._whole is not None:  # its pool is its own: nothing to order, nothing to force
            self._pending = _WholeCall(*self._whole, out)
            self._whole = None
            return
        if self._synced:
            mx.async_eval(out)  # the pool's next write must not overtake this read

    def check(self) -> None:
        pass

    def settle(self, stats: Stats) -> None:
        pass

    def close(self) -> None:
        self._pending = self._older = None
        self.whole_reads.close()
        if self.staging is not None and self.staging.copies is not None:
            self.staging.copies.close()  # made for this cache with its staging (make_cache)
        if self.prefetcher is not None:
            self.prefetcher.close()
