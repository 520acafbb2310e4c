"""``TableCache``: a ``BudgetCache`` whose decode lookups run on the GPU (CUDA).

Decode calls (one token) on partially cached layers look their slots up on the GPU
(``table_kernels.resolve``), and only the GPU waits, only on misses, for the miss server process,
which owns those layers' eviction policy (``miss_client``, ``miss_server``). A short multi-token
call verifying draft tokens (``StreamingRuntime.verifying_drafts``) is one table call too
(``_fits_whole``), however many experts it names: the server admits what the slots hold, and
the expert kernels read the rest where it lies (``cache.pool.InPlaceExperts``), in the pinned
expert files or in the staging the server read it into. A pass whose misses the staging cannot
hold (large experts) is served a token at a time instead (``waves``): its first token announces
every token's experts, so the server reads the pass's union at once and keeps its resident
experts until the last token; no host sync either way.
Synced calls (prefill) ask the server to admit experts
into the same table and write the bytes themselves, in place. Fully cached layers stay as in
``BudgetCache`` (slot == expert id), unless ``every_layer`` (benchmarks: the cost of the lookup
itself).

Who writes what: the table (expert -> slot) and the policy's bookkeeping belong to the miss
server; this process writes pool bytes only from synced calls, after waiting for every table call
already submitted (``synchronize``), in place, since built-but-unsubmitted calls pick their slots
when they run (write_cuda.cuh). The server writes a staging's rows only while it answers a
request; the GPU reads them after the answer (fill, and the expert kernels for the experts a
pass left outside the slots), and the next request that could rewrite them comes from a later
table call, which stream order (and ``resolve``'s ``after``) puts after those reads.
"""

from __future__ import annotations

import functools
import time
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..cache.budget import BudgetCache
from ..cache.policy import POLICIES
from ..cache.pool import DeviceStaging, ExpertPool, InPlaceExperts, SlotPool, whole_blobs
from ..format.layout import ModelLayout
from ..io.prefetch import Prefetcher
from ..io.store import ExpertStore
from ..options import LoadOptions
from ..stats import LayerStats, Stats
from . import layer_copy, table_kernels
from .control_block import HOST_ADMIT, HOST_RELEASE, MAX_SELECTIONS, ControlBlock, TableLayer
from .miss_client import MissServer
from .pinned_files import PinnedExperts
from .runtime import PinnedBuffer


def table_layers(layout: ModelLayout, n_slots: dict, every_layer: bool = False) -> dict:
    """layer -> (num_experts, n_slots) of the layers the table serves: those partially cached
    (and, with ``every_layer``, the fully cached ones too)."""
    out = {}
    for i, n in n_slots.items():
        e = layout.layers[i].num_experts
        if 0 < n < e or (every_layer and n == e):
            out[i] = (e, n)
    return out


# tokens of a call served a token at a time (``waves``): a speculative pass verifies a few draft
# tokens; a longer call (a prefill) takes one host sync instead of as many table calls
MAX_WAVES = 8


class TableCache(BudgetCache):
    """Slots under a byte budget; decode lookups of partially cached layers on the GPU."""

    name = "table"

    def __init__(
        self,
        store: ExpertStore,
        layout: ModelLayout,
        budget_bytes: int,
        options: LoadOptions,
        staging: Optional[DeviceStaging] = None,
        prefetcher: Optional[Prefetcher] = None,
    ):
        # the miss server keeps the table layers' policy, this process the others'
        super().__init__(
            store,
            layout,
            budget_bytes,
            staging,
            prefetcher,
            policy=POLICIES[options.eviction],
            prefill_whole_layer=options.prefill_whole_layer,
            prefill_read_ahead=options.prefill_read_ahead,
            prefill_warm_slots=options.prefill_warm_slots,
            prefill_learns=options.prefill_learns,
        )
        self.name = "table"  # not the policy's name (BudgetCache's)
        self.wait_s = options.wait_timeout_s
        self.control = ControlBlock(
            table_layers(layout, self.n_slots, options.table_every_layer), allocate=PinnedBuffer
        )
        self.pinned: Optional[PinnedExperts] = None
        # layer -> where its experts lie for the expert kernels: a pass may outgrow its slots
        self.in_place: Dict[int, InPlaceExperts] = {}
        # layer -> the same in its staging (None: not readable there), made on first use
        self._in_staging: Dict[int, Optional[InPlaceExperts]] = {}
        try:
            if options.pin_experts:  # before any kernel is made: the layers' launches use them
                self.pinned = PinnedExperts(store, self.control.layers)
                for layer, sources in self.pinned.sources.items():
                    self.control.layers[layer].sources = sources
                    where = sources.in_place(store.layout(layer))
                    if where is not None:
                        self.in_place[layer] = where
                    # a prefill's whole layer: copied by the GPU out of the files, never read
                    self.whole_reads.pinned[layer] = functools.partial(
                        layer_copy.copy_pinned, sources, store.layout(layer)
                    )
            # the server opens the same expert files itself
            self.server = MissServer(
                self.control,
                store,
                options.wait_timeout_s,
                options.server_poll_us,
                options.server_poll_max_us,
                read_ahead=options.prefetch,
                eviction=options.eviction,
                in_place=sorted(self.pinned.sources) if self.pinned is not None else (),
            )
        except BaseException:
            if self.pinned is not None:
                self.pinned.close()
            self.control.close()
            raise
        self._streams: List[mx.Stream] = []  # streams table calls were enqueued on
        self._last_table_out: Optional[mx.array] = None  # see resolve's ``after``
        self._table_call = False  # whether the last lookup went through the table
        self._enqueued = False  # whether a table call was enqueued since ``synchronize``
        self._whole_pass: Optional[int] = None  # the layer whose pass ``waves`` left whole
        self._whole_outside = False  # and whether its slots may name experts outside the pool

    def _table(self, layer: int) -> Optional[TableLayer]:
        return self.control.layers.get(layer)

    # -- BudgetCache's hooks: the server keeps the bookkeeping of table layers ----------------

    def slot_of(self, layer: int) -> Optional[np.ndarray]:
        t = self._table(layer)
        return t.slot_of if t is not None else super().slot_of(layer)

    def _fills_whole(self, layer: int) -> bool:
        return self._table(layer) is None and super()._fills_whole(layer)

    def _keeps_policy(self, layer: int) -> bool:
        return self._table(layer) is None

    def _admit(self, layer: int, experts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        if self._table(layer) is None:
            return super()._admit(layer, experts)
        # A table call already submitted but not yet run would look slots up after the
        # admission below and read them before its writes: let it finish first. (Calls built
        # but not submitted run after the writes, which are in place: see write_cuda.cuh.)
        # None since the last wait: nothing to wait for (a prefill's computation runs on).
        # (A call built before that wait and submitted after it is in flight, unflagged.)
        if self._enqueued or self.control.in_flight():
            self.synchronize()
        # a fully cached table layer (every_layer) is filled whole, like a resident layer
        num = self.store.layout(layer).num_experts
        admit = np.arange(num) if self.n_slots[layer] == num else experts
        return self.server.host_request(layer, HOST_ADMIT, admit)

    def _held(self, layer: int, experts: np.ndarray) -> Optional[Tuple[SlotPool, np.ndarray]]:
        if self._table(layer) is not None and layer in self.pools:
            # a table call of the layer still running could change its slots while they are
            # looked up and copied: let it finish first (later ones run after the copy)
            self.synchronize()
        return super()._held(layer, experts)

    def _assigned(self, layer: int, missing: np.ndarray, victims: np.ndarray) -> None:
        if self._table(layer) is None:
            super()._assigned(layer, missing, victims)

    def _release(self, layer: int, missing: np.ndarray) -> None:
        if self._table(layer) is not None:
            self.server.host_request(layer, HOST_RELEASE, missing)

    def _observe(self, layer: int, rows: np.ndarray) -> None:
        if self._table(layer) is None:
            return super()._observe(layer, rows)
        self.server.observe(layer, rows)  # no slot changes: the GPU may run on meanwhile

    def _write(
        self, layer: int, pool: SlotPool, slots: np.ndarray, blobs: np.ndarray, stats: LayerStats
    ) -> None:
        if self._table(layer) is None or not pool.device_writes:  # host writes land at once
            return super()._write(layer, pool, slots, blobs, stats)
        # enqueued now; the next layer's sync orders it before the staging's reuse
        t0 = time.perf_counter()
        mx.async_eval(
            table_kernels.write_in_place(
                pool.staged(blobs), slots, pool.raw, pool.layout, self.wait_s
            )
        )
        stats.upload_s += time.perf_counter() - t0

    def _copy_in(
        self, layer: int, pool: SlotPool, slots: np.ndarray, whole: ExpertPool, experts: np.ndarray
    ) -> None:
        if self._table(layer) is None or not pool.device_writes:
            return super()._copy_in(layer, pool, slots, whole, experts)
        blobs = whole_blobs(whole, pool.layout, experts)  # in place, as ``_write``
        mx.async_eval(
            table_kernels.write_in_place(blobs, slots, pool.raw, pool.layout, self.wait_s)
        )

    # -- the protocol ------------------------------------------------------------------------

    def lookup(
        self, layer: int, x: mx.array, indices: mx.array, stats: LayerStats
    ) -> Tuple[mx.array, ExpertPool]:
        if not self._serves(layer, indices):
            self._table_call = False
            return super().lookup(layer, x, indices, stats)
        self.begin_call(layer)
        whole = indices.size != indices.shape[-1]  # a speculative pass served as one call
        if self.server.read_ahead and self.predictor is not None and not whole:
            ahead = self.predictor(layer, x, indices.shape[-1])
            if ahead is not None and self._table(ahead[0]) is not None:  # the server reads ahead
                indices = self._hint(ahead[0], indices, ahead[1])
        slots, pool = self._resolve(layer, indices, whole and self._whole_outside)
        self._table_call = True
        stats.calls += 1
        stats.unsynced_calls += 1
        stats.tokens += indices.size // indices.shape[-1]
        stats.experts_routed += indices.size
        return slots, pool

    def waves(
        self, layer: int, indices: mx.array, outside: bool = False
    ) -> Optional[List[mx.array]]:
        """A speculative pass's call on a table layer (2 or more tokens, all their selections
        within a hint) as one table call per token, the first announcing every token's experts
        (``table_kernels.hint``); None for any other call, and for a pass whose selections
        all fit the layer's slots and the copy list at once (``_fits_whole``), which
        ``lookup`` then serves as one table call.

        The hint has no ``after`` edge: of forward passes built and evaluated together, a later
        one's hint may run before an earlier one's calls of the layer end, and then covers the
        wrong calls. That costs reads ahead, never exactness: each call resolves its own
        experts. (Decoding evaluates each pass before it builds the next.)"""
        if self._table(layer) is None:
            return None
        k = indices.shape[-1]
        n = indices.size // k
        if not 2 <= n <= MAX_WAVES or n * k > MAX_SELECTIONS:
            return None
        if not table_kernels.fits(k, self.n_slots[layer]):
            return None
        if self._fits_whole(layer, indices, outside):
            self._whole_pass, self._whole_outside = layer, outside
            return None
        rows = indices.reshape(n, k)
        self._enqueued = True
        first = table_kernels.hint(
            self.control, self._staging_for(layer, k), layer, rows[:1], rows, self.wait_s
        )
        return [first] + [rows[t : t + 1] for t in range(1, n)]

    def computed(self, out: mx.array) -> None:
        if self._table_call:  # the next table call's lookup runs after it (resolve's ``after``)
            self._last_table_out = out
        else:
            super().computed(out)

    def _serves(self, layer: int, indices: mx.array) -> bool:
        """Decode calls (one token) of table layers, and a speculative pass ``waves`` left
        whole."""
        if self._table(layer) is None:
            return False
        if self._whole_pass == layer:
            self._whole_pass = None
            return True
        return indices.size == indices.shape[-1] and table_kernels.fits(
            indices.size, self.n_slots[layer]
        )

    def _fits_whole(self, layer: int, indices: mx.array, outside: bool) -> bool:
        """Whether one table call can serve a pass: its selections (duplicates counted) within
        one request, and its misses within what one answer brings: with pinned files the copy
        list, else the staging's rows. Then its union is admitted at once, and the expert
        kernels run once for all its tokens, as for an all-resident pass. With ``outside`` (the
        expert computation reads experts outside the pool) a union larger than the slots is
        served too: the server admits what the slots hold, resident experts first
        (``miss_server.within_slots``), and leaves the rest in the pinned files, or reads it
        into the staging after the misses."""
        n, k = indices.size, indices.shape[-1]
        if n > MAX_SELECTIONS:
            return False
        pinned = self.control.layers[layer].sources is not None
        if not pinned and n > table_kernels.staging_rows(k, self._blob(layer)):
            return False  # the staging takes every miss of the answer
        if table_kernels.fits(n, self.n_slots[layer]):
            return True
        return outside and self._outside(layer, k)[1] is not None

    def _outside(self, layer: int, top_k: int) -> Tuple[int, Optional[InPlaceExperts]]:
        """Where the expert kernels read the experts a pass leaves out of the layer's slots,
        with ``resolve``'s mode for it: the pinned files, the staging, or ``(0, None)``."""
        if self.control.layers[layer].sources is not None:
            where = self.in_place.get(layer)
            return (table_kernels.IN_FILES, where) if where is not None else (0, None)
        where = self._staged(layer, top_k)
        return (table_kernels.IN_STAGING, where) if where is not None else (0, None)

    def _staged(self, layer: int, top_k: int) -> Optional[InPlaceExperts]:
        """Where the expert kernels read experts from the layer's staging (None: they cannot)."""
        if layer not in self._in_staging:
            buf = self._staging_for(layer, top_k)
            self._in_staging[layer] = InPlaceExperts.of_blobs(
                buf.array, buf.device_ptr, self.store.layout(layer)
            )
        return self._in_staging[layer]

    def _blob(self, layer: int) -> int:
        return self.store.layout(layer).blob_size

    def _staging_for(self, layer: int, top_k: int) -> PinnedBuffer:
        blob = self._blob(layer)
        return self.server.staging_for(blob, table_kernels.staging_rows(top_k, blob))

    def _hint(self, layer: int, indices: mx.array, predicted: mx.array) -> mx.array:
        """``indices`` passed on (lazy) once the GPU has published ``predicted``, the experts
        table layer ``layer`` (the next one) is predicted to route to, for the server to read."""
        self._enqueued = True
        return table_kernels.hint(
            self.control,
            self._staging_for(layer, indices.shape[-1]),
            layer,
            indices,
            predicted,
            self.wait_s,
        )

    def _resolve(
        self, layer: int, indices: mx.array, whole: bool = False
    ) -> Tuple[mx.array, ExpertPool]:
        """Lazy slots of one token's experts, or of a whole pass's (``whole``: some may lie
        outside the pool, and the pool returned says where); the GPU waits for the miss server
        on misses."""
        pool = self._pool(layer)
        stream = mx.default_stream(mx.default_device())
        if stream not in self._streams:
            self._streams.append(stream)
        k = indices.shape[-1]
        mode, where = self._outside(layer, k) if whole else (0, None)
        if where is not None and pool.in_place is not where:
            pool.read_in_place(where)
        slots = table_kernels.resolve(
            self.control,
            self._staging_for(layer, k),  # a whole pass's misses fit it (_fits_whole)
            layer,
            indices,
            pool.raw,
            pool.layout,
            self.wait_s,
            after=self._last_table_out,
            in_place=mode,
        )
        self.server.enqueued(layer)
        self._enqueued = True
        return slots, pool.wide() if mode else pool.pool

    def check(self) -> None:
        """Raise what the miss server or the GPU ran into since the last call."""
        self.server.check()

    def synchronize(self) -> None:
        """Wait for every enqueued table call, on whichever stream it was enqueued."""
        for stream in self._streams:
            mx.synchronize(stream)
        mx.synchronize()
        self._enqueued = False

    def settle(self, stats: Stats) -> None:
        """Wait for enqueued work, then count the misses the server read for it in ``stats``."""
        self.synchronize()
        self.server.fold_stats(stats.layer)

    def close(self) -> None:
        self._last_table_out = None
        self._in_staging.clear()
        for pool in self.pools.values():  # their views of the files and the staging go
            pool.read_in_place(None)
        try:
            self.synchronize()  # a GPU wait still enqueued is answered before the server stops
        finally:
            try:
                self.server.close()
            finally:
                if self.pinned is not None:  # it waits for every kernel that reads them
                    self.whole_reads.pinned.clear()
                    self.in_place.clear()
                    self.pinned.close()
                super().close()
