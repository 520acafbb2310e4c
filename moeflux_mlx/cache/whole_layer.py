"""A prefill at a small budget: each partly cached layer read whole, without a host sync
(``WholeLayerPrefill``), the next layer's read started while this one computes
(``WholeLayerReads``).

A call on a layer with fewer slots than experts that routes many rows per expert (a prefill)
reads the whole layer into a pool of its own that nothing ever writes again, and its router
indices are the slots. The model's graph then stays lazy, as stock mlx-lm's: outputs nobody asks
for (the last layer's, in a prefill chunk) are never computed. Memory stays bounded: the next
such call of the same forward pass starts the previous layer's computation, reads its own layer
meanwhile, and waits for the layer before that, so at most two of these pools are alive and the
device always has a layer queued; a call on an earlier layer (a new forward pass) forgets the
previous one without forcing it.

A prefill reads each layer's every expert, one layer after another, in an order known in
advance. ``WholeLayerReads`` starts the next layer's read as soon as a layer's read is taken, on
a thread of its own, so the reads run back to back while the device computes, instead of each
waiting for its layer's call.

Who writes what, and when:
- Every read, ahead or not, runs on the one read thread, in the order it was asked for: a read
  never writes a buffer while an earlier one (even one abandoned by an interrupt) still does.
  The caller waits for a read it takes (``_settle``).
- Page-locked staging (CUDA, ``LayerStaging``) alternates between two buffers of a layer each,
  one being copied out of while the next layer is read into the other. ``take`` returns once
  its layer's copies have landed, so a buffer is handed to a new read only after the copies
  out of it have.
- A layer's device arrays reach MLX only once their copies have landed: the copy engine runs
  on a stream MLX cannot wait for, so ``take`` waits for it on the host. ``lookup`` queues the
  previous layer's computation first, so the copy of layer L runs beside the computation of
  layer L-1 (``cuda.layer_copy`` says what of it may wait).
- Every read takes all of the store's read threads, whatever its I/O mode (``store.read``'s
  ``whole``): one thread copying out of a mapping moved 1.8 GB/s on an H200's host, 16 preads
  28-35 GB/s, faster than the copy to the device (``benchmarks/transfer.py``).
- Host-written pools (CPU, Metal) are filled by the read itself, into arrays the caller made for
  that layer; nothing writes them again.
- The read thread is handed numpy views and addresses made by the caller; it never calls MLX.
- A layer in ``pinned`` (CUDA, ``pin_experts``) is not read at all: ``take`` has the GPU
  copy it out of the page-locked expert files (nobody writes those).
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np
import psutil

from ..counters import LayerStats
from ..format.layout import ExpertLayout
from ..io.store import ExpertStore
from .pool import MX_DTYPES, STAGING_KEEP_BYTES, ExpertPool, host_view
from .protocol import LayerStaging

log = logging.getLogger(__name__)

# a layer is read ahead only while it takes at most this share of the memory available: its
# bytes are held beside the two layers' pools a prefill already keeps
READ_AHEAD_RAM_SHARE = 0.25
# a whole-layer call's latest rows the eviction policy learns from: the prompt's end is what the
# decode continues, and a learning policy's update costs per row
OBSERVE_ROWS = 128


@functools.cache
def _alloc_stream() -> mx.Stream:
    """A CPU stream of this module's own for host-written pools: their allocations are ready
    without waiting for the computation queued on the default stream."""
    return mx.new_stream(mx.cpu)


@dataclass
class _Read:
    """One layer's read: where its bytes go, and the read itself once started."""

    layer: int
    layout: ExpertLayout
    blobs: np.ndarray  # [n, blob_size] host bytes
    staged: Optional[int]  # the page-locked staging buffer ``blobs`` lies in (CUDA); None: host
    raw: Optional[Dict[str, mx.array]]  # host writes: the pool's arrays, filled by the read
    views: List[Tuple[np.ndarray, int, int]]  # host writes: (view of raw, offset, nbytes) each
    future: Optional[Future] = None  # the read, on the read thread


class _WholeCall(NamedTuple):
    """A whole-layer call once its computation is built: what the next call waits on and the
    eviction policy learns from."""

    layer: int
    pool: ExpertPool
    indices: mx.array
    out: mx.array


class WholeLayerPrefill:
    """The whole-layer path of a prefill (see the module's text).

    Args:
        store: the expert store.
        staging: page-locked staging the GPU copies layers out of (CUDA); None: host writes.
        slot_count: a layer's slots (fewer than its experts: the layer may be read whole).
        learn: ``learn(layer, rows)``: the layer's eviction policy learns from ``rows``
            (``[n, top_k]``, the latest rows of a whole-layer call, in token order).
        threshold: rows per expert from which a call reads its layer whole (0: never).
    """

    def __init__(
        self,
        store: ExpertStore,
        staging: Optional[LayerStaging],
        slot_count: Callable[[int], int],
        learn: Callable[[int, np.ndarray], None],
        threshold: float,
    ):
        self.store, self.slot_count, self.learn = store, slot_count, learn
        self.threshold = threshold
        self.reads = WholeLayerReads(store, staging)
        # Who writes what: only this object, on the model's thread. ``_pending``: the last
        # whole-layer call once computed lazily, not forced yet; ``_older``: the one before,
        # queued, not yet waited for.
        self._pending: Optional[_WholeCall] = None
        self._older: Optional[_WholeCall] = None
        self._partial: Optional[List[int]] = None  # layers with fewer slots than experts

    def begin(self, layer: int) -> None:
        """Every call of the model starts here: a call on the layer of the held whole-layer
        output or an earlier one starts a new forward pass, whose predecessor's unused output
        stays lazy and is let go (with its pool)."""
        if self._pending is not None and self._pending.layer >= layer:
            older, self._pending, self._older = self._older, None, None
            if older is not None:  # computed by the pass that ended (its output fed the next)
                self._learn(older)

    def takes(self, layer: int, indices: mx.array) -> bool:
        """Whether this call reads its whole layer without a host sync: the layer has fewer
        slots than experts, and the call routes ``threshold`` rows per expert or more (the
        shape needs no sync)."""
        if self.threshold <= 0:
            return False
        n = self.store.layout(layer).num_experts
        return self.slot_count(layer) < n and indices.size >= self.threshold * n

    def lookup(self, layer: int, indices: mx.array, stats: LayerStats) -> ExpertPool:
        """Every expert of the layer in a pool of its own (slot == expert id): the router's
        indices go to the computation unchanged, with no host sync."""
        prev, self._pending = self._pending, None
        if prev is not None:
            mx.async_eval(prev.out)  # the previous layer computes while this one is copied
        t0 = time.perf_counter()
        # Wait for the output of the layer before the previous one (its pool is freed then: with
        # the previous layer's and this one's, at most two such pools alive). The previous
        # layer's computation stays queued, so the device works on while Python builds the next
        # layer.
        older, self._older = self._older, prev
        if older is not None:
            mx.eval(older.out)
        stats.sync_s += time.perf_counter() - t0  # waiting for the device
        if older is not None:
            self._learn(older)
        del older  # its pool is freed here, before this layer's arrays are made
        pool = self.reads.take(layer, stats)
        nxt = self._next(layer)
        if nxt is not None:
            self.reads.ahead(nxt)
        n = self.store.layout(layer).num_experts
        stats.calls += 1
        stats.unsynced_calls += 1
        stats.tokens += indices.size // indices.shape[-1]  # the shape needs no sync
        # which were routed is not known without a sync: each expert read counts as routed+missed
        stats.experts_routed += n
        stats.experts_missed += n
        return pool

    def computed(self, layer: int, pool: ExpertPool, indices: mx.array, out: mx.array) -> None:
        """``out`` reads ``pool`` (from ``lookup``): held lazily until the next call needs it
        (its pool is its own: nothing to order, nothing to force)."""
        self._pending = _WholeCall(layer, pool, indices, out)

    def _next(self, layer: int) -> Optional[int]:
        """The layer after ``layer`` that a prefill's forward pass reads whole next."""
        if self._partial is None:
            self._partial = [
                i
                for i in sorted(self.store.layers)
                if self.slot_count(i) < self.store.layout(i).num_experts
            ]
        return next((i for i in self._partial if i > layer), None)

    def _learn(self, call: _WholeCall) -> None:
        """Once a whole-layer call has computed (its indices are in memory by then: no wait),
        the layer's eviction policy learns from its latest rows."""
        if self.slot_count(call.layer) <= 0:
            return
        rows = np.array(call.indices).reshape(-1, call.indices.shape[-1]).astype(np.int64)
        self.learn(call.layer, rows[-OBSERVE_ROWS:])

    def close(self) -> None:
        self._pending = self._older = None
        self.reads.close()


class WholeLayerReads:
    """Reads whole layers for ``WholeLayerPrefill``, the next one in the background.

    Args:
        store: the expert store.
        staging: page-locked staging the GPU copies layers out of (CUDA); None: host writes.
    """

    def __init__(self, store: ExpertStore, staging: Optional[LayerStaging]):
        self.store, self.staging = store, staging
        self._thread: Optional[ThreadPoolExecutor] = None  # the read thread
        self._ahead: Optional[_Read] = None
        self._turn = 0  # the staging buffer the next read takes
        self._host_buf: Optional[np.ndarray] = None  # host writes: the read's own buffer
        # layer -> a function copying its every expert's components out of the pinned expert
        # files into device arrays (set by the cache that pinned them, before the first prefill)
        self.pinned: Dict[int, Callable[[], Dict[str, mx.array]]] = {}

    # -- buffers ---------------------------------------------------------------------------

    def _staging_buffer(self, n: int, blob_size: int) -> Tuple[int, np.ndarray]:
        """The next staging buffer and a ``[n, blob_size]`` host view of it. No MLX operation
        here: one queued on the default stream would wait for the computation queued there
        before the read could start."""
        assert self.staging is not None
        i, self._turn = self._turn, (self._turn + 1) % self.staging.BUFFERS
        return i, self.staging.buffer(i, n, blob_size)

    def _host_buffer(self, n: int, blob_size: int) -> np.ndarray:
        nbytes = n * blob_size
        if nbytes > STAGING_KEEP_BYTES:
            return np.empty((n, blob_size), np.uint8)
        if self._host_buf is None or self._host_buf.size < nbytes:
            self._host_buf = np.empty(nbytes, np.uint8)
        return self._host_buf[:nbytes].reshape(n, blob_size)

    def _prepare(self, layer: int) -> _Read:
        """Where ``layer``'s bytes will go (on the caller's thread: it may call MLX)."""
        layout = self.store.layout(layer)
        n, size = layout.num_experts, layout.blob_size
        if self.staging is not None:
            staged, blobs = self._staging_buffer(n, size)
            return _Read(layer, layout, blobs, staged, None, [])
        with mx.stream(_alloc_stream()):  # not queued behind the default stream's computation
            raw = {c.name: mx.zeros((n, c.nbytes), mx.uint8) for c in layout.components}
            mx.eval(list(raw.values()))
        views = [(host_view(raw[c.name]), c.offset, c.nbytes) for c in layout.components]
        return _Read(layer, layout, self._host_buffer(n, size), None, raw, views)

    # -- reads -----------------------------------------------------------------------------

    def _start(self, read: _Read) -> None:
        """Queue ``read`` on the read thread and track it (``_settle`` waits for it)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="moeflux-layer-read")
        self._ahead = read  # tracked before it is queued: an interrupt cannot lose it
        read.future = self._thread.submit(_fill, self.store, read)

    def _settle(self) -> Optional[_Read]:
        """The read ahead, once ended (None: none, or it failed: the caller reads again, so a
        lasting fault raises from the call that needs the layer)."""
        ahead = self._ahead
        future = None if ahead is None else ahead.future
        if ahead is not None and future is not None:
            try:
                future.result()
            except Exception as err:  # noqa: BLE001 - any failure: read again, by the caller
                log.debug("layer %d: read ahead failed (%s); reading it again", ahead.layer, err)
                ahead = None
            except BaseException:
                # an interrupt leaves a read still running in ``_ahead``, for the next settle
                if future.done():
                    self._ahead = None
                raise
        elif ahead is not None:  # never queued
            ahead = None
        self._ahead = None
        return ahead

    def _start_prepared(self, layer: int) -> None:
        """``_prepare`` and ``_start`` ``layer``'s read."""
        self._start(self._prepare(layer))

    def take(self, layer: int, stats: LayerStats) -> ExpertPool:
        """``layer``'s every expert as a pool of its own (slot == expert id): the read ahead if
        it was this layer's, else read now. With device staging the pool's arrays are copied
        by the copy engine, landed on return.

        Raises:
            ExpertReadError: the layer's read failed.
        """
        t0 = time.perf_counter()
        if layer in self.pinned:
            layout = self.store.layout(layer)
            pool = _typed_pool(self.pinned[layer](), layout)
            stats.experts_read += layout.num_experts
            stats.bytes_read += layout.num_experts * layout.blob_size
            stats.upload_s += time.perf_counter() - t0
            return pool
        read = self._settle()
        if read is None or read.layer != layer:
            self._start_prepared(layer)
            read = self._settle()
            if read is None:  # it failed: again, on this thread, to raise the error from here
                read = self._prepare(layer)
                _fill(self.store, read)
        t1 = time.perf_counter()
        stats.io_s += t1 - t0  # the wait: what the read ahead did not hide
        stats.experts_read += read.layout.num_experts
        stats.bytes_read += read.blobs.nbytes
        pool = self._pool(read, self.staging)
        stats.upload_s += time.perf_counter() - t1
        return pool

    def ahead(self, layer: int) -> None:
        """Start reading ``layer`` in the background (nothing if the layer would take more than
        ``READ_AHEAD_RAM_SHARE`` of the memory available)."""
        if layer in self.pinned:  # a pinned layer is copied when taken
            return
        self._settle()
        layout = self.store.layout(layer)
        nbytes = layout.num_experts * layout.blob_size
        if nbytes > READ_AHEAD_RAM_SHARE * psutil.virtual_memory().available:
            return
        try:
            self._start_prepared(layer)
        except Exception as err:  # noqa: BLE001 - no room for a read ahead: the call reads itself
            log.debug("layer %d: no read ahead (%s)", layer, err)

    @staticmethod
    def _pool(read: _Read, staging: Optional[LayerStaging]) -> ExpertPool:
        layout = read.layout
        if read.staged is None:
            assert read.raw is not None
            return _typed_pool(read.raw, layout)
        assert staging is not None
        return _typed_pool(staging.copy(read.staged, layout, f"layer {read.layer}"), layout)

    def close(self) -> None:
        """Wait for a read under way and let go of the buffers."""
        self._settle()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self.staging is not None:
            self.staging.close()
        self._host_buf = None


def _typed_pool(raw: Dict[str, mx.array], layout: ExpertLayout) -> ExpertPool:
    """A layer's every expert as a pool, from each component's ``[n, nbytes]`` uint8 array."""
    n = layout.num_experts
    arrays = {
        c.name: raw[c.name].view(MX_DTYPES[c.dtype]).reshape(n, *c.shape) for c in layout.components
    }
    return ExpertPool(arrays, layout.quantization, layout.overrides)


def _fill(store: ExpertStore, read: _Read) -> None:
    """Read ``read.layer``'s blobs into ``read.blobs``; then, for host writes, scatter them into
    the pool's arrays through ``read.views``. No MLX here: it runs on the read thread."""
    store.read(read.layer, np.arange(len(read.blobs)), read.blobs, whole=True)
    for view, offset, nbytes in read.views:
        view[:] = read.blobs[:, offset : offset + nbytes]
