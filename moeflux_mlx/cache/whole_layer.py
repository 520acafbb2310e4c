"""Whole-layer reads of a prefill at a small budget (``HostSyncCache.whole_lookup``), read ahead.

A prefill reads each layer's every expert, one layer after another, in an order known in
advance. ``WholeLayerReads`` starts the next layer's read as soon as a layer's read is taken, on
a thread of its own, so the reads run back to back while the device computes, instead of each
waiting for its layer's call.

Who writes what, and when:
- Every read, ahead or not, runs on the one read thread, in the order it was asked for: a read
  never writes a buffer while an earlier one (even one abandoned by an interrupt) still does.
  The caller waits for a read it takes (``_settle``).
- A buffer is handed to a new read only after the device copies out of it were evaluated
  (``whole_lookup`` evaluates the previous layer's copies before it takes or starts a read):
  device staging (CUDA) alternates between two buffers, one being copied out of while the next
  layer is read into the other.
- With ``DeviceStaging.copies`` (the GPU's copy engines) the read thread itself copies each
  piece of the layer it has read into arrays made for that layer, and waits for those copies
  before its read ends, even a failed one: its one host buffer is free again when the next
  read starts, and no computation reads the arrays before the read was taken.
- Host-written pools (CPU, Metal) are filled by the read itself, into arrays the caller made for
  that layer; nothing writes them again.
- The read thread is handed numpy views and addresses made by the caller; it never calls MLX.
- A layer in ``pinned`` (CUDA, ``pin_experts``) is not read at all: ``take`` queues the GPU's
  copy of it out of the page-locked expert files (nobody writes those) on the copy stream.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
import psutil

from ..format.layout import ExpertLayout
from ..io.store import ExpertStore
from ..stats import LayerStats
from .pool import MX_DTYPES, STAGING_KEEP_BYTES, DeviceStaging, ExpertPool, host_view
from .row_copies import HostBuffer, RowCopies

log = logging.getLogger(__name__)

# a layer is read ahead only while it takes at most this share of the memory available: its
# bytes are held beside the two layers' pools a prefill already keeps
READ_AHEAD_RAM_SHARE = 0.25
# with copy engines a layer is read in pieces of about this size, each copied to the device while
# the next is read: only the last piece's copies add to the read
COPY_PIECE_BYTES = 32 << 20

_STREAMS: Dict[Tuple[str, str], mx.Stream] = {}


def _stream(what: str) -> mx.Stream:
    """A stream of this module's own: "alloc" on the CPU (pool allocations, ready without
    waiting for the computation queued on the default stream), "copy" on the default device
    (the copies out of device staging, which then run beside that computation)."""
    device = mx.cpu if what == "alloc" else mx.default_device()
    key = (what, str(device))
    if key not in _STREAMS:
        _STREAMS[key] = mx.new_stream(device)
    return _STREAMS[key]


@dataclass
class _Read:
    """One layer's read: where its bytes go, and the read itself once started."""

    layer: int
    layout: ExpertLayout
    blobs: np.ndarray  # [n, blob_size] host bytes
    # the device-readable staging buffer (CUDA) whose first bytes are ``blobs``, evaluated and
    # never sliced on the default stream; None: host writes
    staged: Optional[mx.array]
    raw: Optional[Dict[str, mx.array]]  # host writes: the pool's arrays, filled by the read
    views: List[Tuple[np.ndarray, int, int]]  # host writes: (view of raw, offset, nbytes) each
    future: Optional[Future] = None  # the read, on the read thread
    # copy engines: the pool's arrays (evaluated, on the device), filled by the read's copies,
    # and (address, offset in a blob, nbytes) of each
    dst: Optional[Dict[str, mx.array]] = None
    targets: List[Tuple[int, int, int]] = field(default_factory=list)
    own: Optional[HostBuffer] = None  # a host buffer of this read alone, let go when it ends


class WholeLayerReads:
    """Reads whole layers for ``HostSyncCache.whole_lookup``, the next one in the background.

    Args:
        store: the expert store (read directly: a prefetcher's predictions are per token).
        staging: device-readable staging (CUDA's device writes); None: host writes.
        read_ahead: start the next layer's read when a layer is taken (``ahead``).
    """

    def __init__(
        self, store: ExpertStore, staging: Optional[DeviceStaging], read_ahead: bool = True
    ):
        self.store, self.staging = store, staging
        self.read_ahead = read_ahead
        self._thread: Optional[ThreadPoolExecutor] = None  # the read thread
        self._ahead: Optional[_Read] = None
        self._bufs: List[Optional[mx.array]] = [None, None]  # device staging, alternating
        self._views: List[Optional[np.ndarray]] = [None, None]  # their host views
        self._turn = 0
        self._host_buf: Optional[np.ndarray] = None  # host writes: the read's own buffer
        self.copies: Optional[RowCopies] = None if staging is None else staging.copies
        self._copy_buf: Optional[HostBuffer] = None  # copy engines: the reads' host buffer
        # layer -> its every expert's components as device arrays, copied lazily out of the
        # pinned expert files (set by the cache that pinned them, before the first prefill)
        self.pinned: Dict[int, Callable[[], Dict[str, mx.array]]] = {}

    # -- buffers ---------------------------------------------------------------------------

    def _staging_buffer(self, n: int, blob_size: int) -> Tuple[mx.array, np.ndarray]:
        """The next of the two staging buffers (not kept beyond ``STAGING_KEEP_BYTES``) and a
        ``[n, blob_size]`` host view of its first bytes. No MLX operation here: one queued on
        the default stream would wait for the computation queued there before the read could
        start."""
        assert self.staging is not None
        nbytes = n * blob_size
        if nbytes > STAGING_KEEP_BYTES:
            big = self.staging.allocate((nbytes,))
            return big, host_view(big).reshape(n, blob_size)
        i, self._turn = self._turn, 1 - self._turn
        buf, view = self._bufs[i], self._views[i]
        if buf is None or view is None or buf.size < nbytes:
            buf = self._bufs[i] = self.staging.allocate((nbytes,))
            view = self._views[i] = host_view(buf).reshape(-1)
        return buf, view[:nbytes].reshape(n, blob_size)

    def _host_buffer(self, n: int, blob_size: int) -> np.ndarray:
        nbytes = n * blob_size
        if nbytes > STAGING_KEEP_BYTES:
            return np.empty((n, blob_size), np.uint8)
        if self._host_buf is None or self._host_buf.size < nbytes:
            self._host_buf = np.empty(nbytes, np.uint8)
        return self._host_buf[:nbytes].reshape(n, blob_size)

    def _copy_buffer(self, n: int, blob_size: int) -> Tuple[np.ndarray, Optional[HostBuffer]]:
        """Copy engines: the host buffer a read fills, and the buffer to let go after it (a
        large one is not kept)."""
        assert self.copies is not None
        nbytes = n * blob_size
        if nbytes > STAGING_KEEP_BYTES:
            own = self.copies.buffer(nbytes)
            return own.array[:nbytes].reshape(n, blob_size), own
        if self._copy_buf is None or self._copy_buf.array.size < nbytes:
            if self._copy_buf is not None:
                self._copy_buf.close()
                self._copy_buf = None
            self._copy_buf = self.copies.buffer(nbytes)
        return self._copy_buf.array[:nbytes].reshape(n, blob_size), None

    def _prepare(self, layer: int) -> _Read:
        """Where ``layer``'s bytes will go (on the caller's thread: it may call MLX)."""
        layout = self.store.layout(layer)
        n, size = layout.num_experts, layout.blob_size
        if self.copies is not None:
            blobs, own = self._copy_buffer(n, size)
            try:
                with mx.stream(_stream("copy")):  # not queued behind the computation
                    dst = {c.name: mx.zeros((n, c.nbytes), mx.uint8) for c in layout.components}
                    mx.eval(list(dst.values()))
            except BaseException:
                if own is not None:
                    own.close()
                raise
            targets = [
                (host_view(dst[c.name]).ctypes.data, c.offset, c.nbytes) for c in layout.components
            ]
            return _Read(layer, layout, blobs, None, None, [], dst=dst, targets=targets, own=own)
        if self.staging is not None:
            staged, blobs = self._staging_buffer(n, size)
            return _Read(layer, layout, blobs, staged, None, [])
        with mx.stream(_stream("alloc")):  # not queued behind the default stream's computation
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
        read.future = self._thread.submit(_fill, self.store, read, self.copies)

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
            _release(ahead)
            ahead = None
        self._ahead = None
        return ahead

    def _start_prepared(self, layer: int) -> None:
        """``_prepare`` and ``_start`` ``layer``'s read; a buffer of its own is let go if the
        read could not be queued (tracked reads are let go by ``_fill`` or ``_settle``)."""
        read = self._prepare(layer)
        try:
            self._start(read)
        except BaseException:
            if self._ahead is not read:
                _release(read)
            raise

    def take(self, layer: int, stats: LayerStats) -> ExpertPool:
        """``layer``'s every expert as a pool of its own (slot == expert id): the read ahead if
        it was this layer's, else read now. With device staging the pool's arrays are copies
        queued on a stream of their own: evaluate them before the next ``take`` or ``ahead``.

        Raises:
            ExpertReadError: the layer's read failed.
        """
        t0 = time.perf_counter()
        if layer in self.pinned:
            layout = self.store.layout(layer)
            with mx.stream(_stream("copy")):  # beside the computation, not behind it
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
                _fill(self.store, read, self.copies)
        t1 = time.perf_counter()
        stats.io_s += t1 - t0  # the wait: what the read ahead did not hide
        stats.experts_read += read.layout.num_experts
        stats.bytes_read += read.blobs.nbytes
        pool = self._pool(read, self.staging)
        stats.upload_s += time.perf_counter() - t1
        return pool

    def ahead(self, layer: int) -> None:
        """Start reading ``layer`` in the background (nothing if reading ahead is off, or the
        layer would take more than ``READ_AHEAD_RAM_SHARE`` of the memory available)."""
        if not self.read_ahead or layer in self.pinned:  # a pinned layer is copied when taken
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
    def _pool(read: _Read, staging: Optional[DeviceStaging]) -> ExpertPool:
        layout = read.layout
        if read.dst is not None:  # copied by the read (copy engines)
            with mx.stream(_stream("copy")):
                return _typed_pool(read.dst, layout)
        if read.staged is None:
            assert read.raw is not None
            return _typed_pool(read.raw, layout)
        # beside the computation on the default stream, not behind it
        assert staging is not None
        with mx.stream(_stream("copy")):
            staged = read.staged[: read.blobs.size].reshape(read.blobs.shape)
            copied = None if staging.copy_layer is None else staging.copy_layer(staged, layout)
            if copied is None:
                copied = {
                    c.name: mx.contiguous(staged[:, c.offset : c.offset + c.nbytes])
                    for c in layout.components
                }
            return _typed_pool(copied, layout)

    def close(self) -> None:
        """Wait for a read under way and let go of the buffers."""
        self._settle()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self._bufs, self._views = [None, None], [None, None]
        self._host_buf = None
        if self._copy_buf is not None:
            self._copy_buf.close()
            self._copy_buf = None


def _typed_pool(raw: Dict[str, mx.array], layout: ExpertLayout) -> ExpertPool:
    """A layer's every expert as a pool, from each component's ``[n, nbytes]`` uint8 array."""
    n = layout.num_experts
    arrays = {
        c.name: raw[c.name].view(MX_DTYPES[c.dtype]).reshape(n, *c.shape) for c in layout.components
    }
    return ExpertPool(arrays, layout.quantization, layout.overrides)


def _fill(store: ExpertStore, read: _Read, copies: Optional[RowCopies]) -> None:
    """Read ``read.layer``'s blobs into ``read.blobs``; then, for host writes, scatter them into
    the pool's arrays through ``read.views``, or, with copy engines, copy each piece to the
    device as soon as it is read. No MLX here: it runs on the read thread."""
    layer, blobs = read.layer, read.blobs
    n = len(blobs)
    if copies is None or read.dst is None:
        store.read(layer, np.arange(n), blobs)
        for view, offset, nbytes in read.views:
            view[:] = blobs[:, offset : offset + nbytes]
        return
    pitch = blobs.shape[1]
    step = max(1, COPY_PIECE_BYTES // pitch)
    failed = False
    try:
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            store.read(layer, np.arange(lo, hi), blobs[lo:hi])
            src = blobs.ctypes.data + lo * pitch
            for dst, offset, nbytes in read.targets:
                copies.copy_rows(dst + lo * nbytes, nbytes, src + offset, pitch, nbytes, hi - lo)
    except BaseException:
        failed = True
        raise
    finally:
        try:
            copies.wait()  # even after a failure: nothing may still write the buffer or arrays
        except Exception as err:
            if not failed:
                raise
            log.warning("layer %d: waiting for its copies failed as well (%s)", layer, err)
        finally:
            _release(read)


def _release(read: _Read) -> None:
    """Let go of a read's own host buffer (once its copies have landed, or none was queued)."""
    if read.own is not None:
        read.own.close()
        read.own = None
