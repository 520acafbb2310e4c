"""``DeviceTable``: decode lookups of partly cached layers on the GPU (CUDA), the optional wing
of ``cache.expert_cache.ExpertCache`` (``cache.protocol.SlotTable``).

Decode calls (one token) on partly cached layers look their slots up on the GPU
(``table_kernels.resolve``), and only the GPU waits, only on misses, for the miss server process,
which owns those layers' eviction policy (``miss_client``, ``miss_server``). A short multi-token
call verifying draft tokens is one table call too (``plan_pass``), however many experts it
names: the server admits what the slots hold, and the expert kernels read the rest where it lies
(``cache.pool.InPlaceExperts``), in the pinned expert files or in the staging the server read it
into. A pass whose misses the staging cannot hold (large experts) is served a token at a time
instead: its first token announces every token's experts, so the server reads the pass's union
at once and keeps its resident experts until the last token; no host sync either way.
Host-synced calls (a short prefill) on the table's layers keep their bookkeeping here too
(``TableBook``): the server admits, this process writes the bytes, in place.

Who writes what: the table (expert -> slot) and the policy's bookkeeping belong to the miss
server; this process writes pool bytes only from synced calls, after waiting for every table call
already submitted (``synchronize``), in place, since built-but-unsubmitted calls pick their slots
when they run (write_cuda.cuh). The server writes a staging's rows only while it answers a
request; the GPU reads them after the answer (fill, and the expert kernels for the experts a
pass left outside the slots), and the next request that could rewrite them comes from a later
table call, which stream order (and ``resolve``'s ``after``) puts after those reads. The pools
themselves are the ``SlotCache``'s: the table reads them, never replaces them.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..cache.pool import ExpertPool, InPlaceExperts, SlotPool, write_blobs
from ..cache.protocol import WHOLE_PASS, PassPlan
from ..cache.slots import SlotCache
from ..counters import LayerStats, Stats
from ..format.layout import ModelLayout
from ..io.store import ExpertStore
from ..options import LoadOptions
from . import layer_copy, table_kernels
from .control_block import HOST_ADMIT, HOST_RELEASE, MAX_SELECTIONS, ControlBlock, TableLayer
from .miss_client import MissServer
from .pinned_files import PinnedExperts, pin_by_default
from .runtime import PinnedBuffer

log = logging.getLogger(__name__)


def table_layers(layout: ModelLayout, n_slots: Dict[int, int]) -> Dict[int, Tuple[int, int]]:
    """layer -> (num_experts, n_slots) of the layers the table serves: those partly cached."""
    out = {}
    for i, n in n_slots.items():
        e = layout.layers[i].num_experts
        if 0 < n < e:
            out[i] = (e, n)
    return out


# tokens of a call served a token at a time: a speculative pass verifies a few draft tokens; a
# longer call (a prefill) takes one host sync instead of as many table calls
MAX_WAVES = 8


class TableBook:
    """A table layer's bookkeeping as the host-synced path sees it: kept by the miss server."""

    def __init__(self, table: DeviceTable, layer: int):
        self.table, self.layer = table, layer

    @property
    def slot_of(self) -> np.ndarray:
        return self.table.control.layers[self.layer].slot_of

    def admit(self, experts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        t = self.table
        # A table call already submitted but not yet run would look slots up after the
        # admission below and read them before its writes: let it finish first. (Calls built
        # but not submitted run after the writes, which are in place: see write_cuda.cuh.)
        # None since the last wait: nothing to wait for (a prefill's computation runs on).
        if t.enqueued or t.control.in_flight():
            t.synchronize()
        return t.server.host_request(self.layer, HOST_ADMIT, experts)

    def assigned(self, missing: np.ndarray, victims: np.ndarray) -> None:
        """The server assigned them when it admitted them."""

    def release(self, missing: np.ndarray) -> None:
        self.table.server.host_request(self.layer, HOST_RELEASE, missing)

    def observe(self, rows: np.ndarray) -> None:
        self.table.server.observe(self.layer, rows)  # no slot changes: the GPU may run on

    def write(self, pool: SlotPool, slots: np.ndarray, blobs: np.ndarray, stats: LayerStats):
        if not pool.device_writes:  # host writes land at once
            write_blobs(pool, slots, blobs, stats)
            return
        # enqueued now; the next layer's sync orders it before the staging's reuse
        t0 = time.perf_counter()
        mx.async_eval(
            table_kernels.write_in_place(
                pool.staged(blobs), slots, pool.raw, pool.layout, self.table.wait_s
            )
        )
        stats.upload_s += time.perf_counter() - t0

    def settle(self) -> None:
        self.table.synchronize()


class DeviceTable:
    """The device-side slot table over ``slots``' pools of its layers (``table_layers``).

    Args:
        store: the expert store (the server opens the same files).
        layout: the model's expert layout.
        slots: the slot cache whose partly cached layers the table serves; their books become
            ``TableBook``s.
        options: the load options (``eviction``, ``pin_experts``, ``tuning``).

    Raises:
        DeviceWaitError: the miss server did not start.
        DeviceSetupError: ``pin_experts`` could not page-lock the expert files.
    """

    def __init__(
        self, store: ExpertStore, layout: ModelLayout, slots: SlotCache, options: LoadOptions
    ):
        self.store, self.slots = store, slots
        tuning = options.tuning
        self.wait_s = tuning.wait_timeout_s
        self.control = ControlBlock(table_layers(layout, slots.n_slots), allocate=PinnedBuffer)
        self.pinned: Optional[PinnedExperts] = None
        # layer -> where its experts lie for the expert kernels: a pass may outgrow its slots
        self.in_place: Dict[int, InPlaceExperts] = {}
        # layer -> the same in its staging (None: not readable there), made on first use
        self._in_staging: Dict[int, Optional[InPlaceExperts]] = {}
        try:
            if self._pins(options.pin_experts):  # before any kernel: the launches use them
                self.pinned = PinnedExperts(store, self.control.layers)
                for layer, sources in self.pinned.sources.items():
                    self.control.layers[layer].sources = sources
                    where = sources.in_place(store.layout(layer))
                    if where is not None:
                        self.in_place[layer] = where
            # the server opens the same expert files itself
            self.server = MissServer(
                self.control,
                store,
                tuning.wait_timeout_s,
                tuning.server_poll_us,
                tuning.server_poll_max_us,
                eviction=options.eviction,
                in_place=sorted(self.pinned.sources) if self.pinned is not None else (),
            )
        except BaseException:
            if self.pinned is not None:
                self.pinned.close()
            self.control.close()
            raise
        for layer in self.control.layers:
            slots.keepers[layer] = functools.partial(TableBook, self, layer)
        self._streams: List[mx.Stream] = []  # streams table calls were enqueued on
        self._last_table_out: Optional[mx.array] = None  # see resolve's ``after``
        self.enqueued = False  # whether a table call was enqueued since ``synchronize``

    def _pins(self, asked: Optional[bool]) -> bool:
        """Whether to pin the table layers' expert files: as asked, else where they fit
        (``pinned_files.pin_by_default``)."""
        if asked is not None:
            return asked
        pin, why = pin_by_default(self.store, self.control.layers)
        log.info("pin_experts auto: %s (%s)", "on" if pin else "off", why)
        return pin

    def whole_layer_copies(self) -> Dict[int, Callable[[], Dict[str, mx.array]]]:
        """A prefill's whole layer copied by the GPU's copy engine out of the pinned files
        (``layer_copy.copy_layer``), never read."""
        if self.pinned is None:
            return {}
        return {
            layer: functools.partial(
                layer_copy.copy_layer, sources, self.store.layout(layer), f"layer {layer}"
            )
            for layer, sources in self.pinned.sources.items()
        }

    def _table(self, layer: int) -> Optional[TableLayer]:
        return self.control.layers.get(layer)

    # -- SlotTable --------------------------------------------------------------------------

    def serves(self, layer: int, indices: mx.array) -> bool:
        """Decode calls (one token) of table layers whose selections fit the layer's slots."""
        return (
            self._table(layer) is not None
            and indices.size == indices.shape[-1]
            and table_kernels.fits(indices.size, self.slots.n_slots[layer])
        )

    def lookup(
        self, layer: int, indices: mx.array, stats: LayerStats, outside: bool = False
    ) -> Tuple[mx.array, ExpertPool]:
        slots, pool = self._resolve(layer, indices, outside)
        stats.calls += 1
        stats.unsynced_calls += 1
        stats.tokens += indices.size // indices.shape[-1]
        stats.experts_routed += indices.size
        return slots, pool

    def computed(self, out: mx.array) -> None:
        self._last_table_out = out  # the next table call's lookup runs after it

    def plan_pass(self, layer: int, indices: mx.array, outside: bool) -> PassPlan:
        """A speculative pass's call on a table layer (2 to ``MAX_WAVES`` tokens, all their
        selections within a request): ``WHOLE_PASS`` where its selections fit the layer's slots
        and one answer's copies at once (``_fits_whole``); else one table call per token, the
        first announcing every token's experts (``table_kernels.hint``); None for any other
        call.

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
        if not table_kernels.fits(k, self.slots.n_slots[layer]):
            return None
        if self._fits_whole(layer, indices, outside):
            return WHOLE_PASS
        rows = indices.reshape(n, k)
        self.enqueued = True
        first = table_kernels.hint(
            self.control, self._staging_for(layer, k), layer, rows[:1], rows, self.wait_s
        )
        return [first] + [rows[t : t + 1] for t in range(1, n)]

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
        if table_kernels.fits(n, self.slots.n_slots[layer]):
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

    def _resolve(
        self, layer: int, indices: mx.array, outside: bool = False
    ) -> Tuple[mx.array, ExpertPool]:
        """Lazy slots of one token's experts, or of a whole pass's (``outside``: some may lie
        outside the pool, and the pool returned says where); the GPU waits for the miss server
        on misses."""
        pool = self.slots.pool(layer)
        stream = mx.default_stream(mx.default_device())
        if stream not in self._streams:
            self._streams.append(stream)
        k = indices.shape[-1]
        mode, where = self._outside(layer, k) if outside else (0, None)
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
        self.enqueued = True
        return slots, pool.wide() if mode else pool.pool

    def check(self) -> None:
        """Raise what the miss server or the GPU ran into since the last call."""
        self.server.check()

    def synchronize(self) -> None:
        """Wait for every enqueued table call, on whichever stream it was enqueued."""
        for stream in self._streams:
            mx.synchronize(stream)
        mx.synchronize()
        self.enqueued = False

    def settle(self, stats: Stats) -> None:
        """Wait for enqueued work, then count the misses the server read for it in ``stats``."""
        self.synchronize()
        self.server.fold_stats(stats.layer)

    def close(self) -> None:
        self._last_table_out = None
        self._in_staging.clear()
        for pool in self.slots.pools.values():  # their views of the files and the staging go
            pool.read_in_place(None)
        try:
            self.synchronize()  # a GPU wait still enqueued is answered before the server stops
        finally:
            try:
                self.server.close()
            finally:
                if self.pinned is not None:  # it waits for every kernel that reads them
                    self.in_place.clear()
                    self.pinned.close()
