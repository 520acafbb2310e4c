"""The expert store: reads the blobs of routed experts from disk into host memory.

The sources of each layer's bytes are ``format.readers``' ``PackedLayer`` / ``SafetensorsLayer``.
Three I/O modes read them: ``pread`` into reusable staging buffers, a call's bytes dealt in equal
shares to a thread pool (the GIL is released while the kernel copies); ``direct``, the same reads
bypassing the page cache (``uncached``); or copies out of an ``mmap`` of the same files. The RAM
gate (``select_expert_io``) chooses among them by the experts' size against RAM.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import psutil

from ..errors import (
    ExpertChecksumError,
    ExpertIndexError,
    ExpertReadError,
    LayoutError,
    ModelClosedError,
)
from ..format import checksums as blob_sums
from ..format import readers
from ..format.checkpoint import (
    LAYOUT_FILE,
    PACKED_DIR,
    check_packed,
    is_packed,
    packed_file,
    scan_checkpoint,
)
from ..format.layout import ExpertLayout, ExpertShard, ModelLayout, Span
from ..format.readers import LayerSource, PackedLayer, SafetensorsLayer, advise_random_reads
from ..format.safetensors import TensorRange
from ..options import DEFAULT_WARM_READ_THREADS, IO_MODES, from_environment
from .uncached import UncachedFile, aligned_empty, open_uncached

log = logging.getLogger(__name__)

RAM_FRACTION = 0.75
# Experts above this many times RAM are read with ``direct`` by default, on Linux. The page cache
# can then hold at most an eighth of them, and there (H200, 25% budget, the page cache held to a
# share of the experts by another process) pread decoded at 0.75x direct with the cache dropped,
# 0.94x with a tenth of the experts cached, 1.25x with a quarter: direct pays below about a
# sixth (docs/results.md, "When direct pays"). macOS's uncached reads (F_NOCACHE) have not been
# measured, so there the gate keeps pread.
DIRECT_RAM_RATIO = 8
STAGING_KEEP_BYTES = 256 << 20  # larger reads (prefill) get a buffer of their own, not kept
# Reads are split into pieces of at most this size across the read threads: one expert read
# as a single pread is latency-bound on a cold disk (a VM disk at 1.6 GB/s with 8 threads
# delivered about 1 GB/s to single 2.6 MB reads).
READ_PIECE_BYTES = 512 << 10
# A call's reads are dealt to the threads as shares of equal bytes, each read in pieces one after
# another: with a queue of pieces the last round ran a few pieces deep while other threads sat
# idle, and a miss batch of a few experts is only a few rounds. Shares are at least this
# large, so a small read is not cut into pieces the disk serves at a lower rate.
MIN_SHARE_BYTES = 256 << 10
# A large call (a prefill's whole layer) is read in larger pieces, this many a share: from the
# page cache a piece's cost is mostly its call's, so fewer, larger pieces read a layer faster.
PIECES_PER_SHARE = 8
PAGE_BYTES = 4096
# A call this small first asks the page cache, without reading, whether it holds the bytes
# (RWF_NOWAIT probes of a few pages), and if so is read on the store's ``warm_threads``
# (options.DEFAULT_WARM_READ_THREADS says why); larger calls keep every thread (from memory 12
# experts of 2.65 MB still read faster on 4 threads than on 16, a whole layer of 64 does not).
WARM_PROBE_MAX_BYTES = 32 << 20
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux only; elsewhere nothing is probed
_PROBE_REFUSED = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
# A part's runs (a tensor-parallel down projection: part of every row) with gaps shorter than
# this are read as one span, gaps included: the disk reads whole pages (16 KiB on Apple silicon)
# anyway, and one read per row would cost a call per row.
SKIP_GAP_BYTES = 16 << 10
_gate_logged: set = set()


def choose_expert_io(total_expert_bytes: int, requested: Optional[str] = None) -> Tuple[str, str]:
    """The RAM gate: the I/O mode for experts of ``total_expert_bytes``, and why.

    ``direct`` when the experts exceed ``DIRECT_RAM_RATIO`` x physical RAM (Linux), ``pread``
    when they exceed ``RAM_FRACTION`` x RAM, else ``mmap``. ``requested`` (the ``expert_io=``
    argument) or ``MOEFLUX_EXPERT_IO`` override it; an unknown mode warns and counts as auto.

    Args:
        total_expert_bytes: the model's expert bytes.
        requested: ``auto``, ``mmap``, ``pread``, ``direct`` or None (the environment, else auto).

    Returns:
        ``(mode, reason)``, e.g. ``("pread", "auto: experts 16.31 GB > 0.75 x RAM 8.59 GB")``.
    """
    ram = psutil.virtual_memory().total
    choice = requested or from_environment().get("expert_io") or "auto"
    if choice not in IO_MODES:
        log.warning(
            "unknown expert I/O mode %r (MOEFLUX_EXPERT_IO / expert_io); using auto; "
            "choose one of %s",
            choice,
            ", ".join(IO_MODES),
        )
        choice = "auto"
    if choice != "auto":
        return choice, "requested"
    experts, of_ram = _size(total_expert_bytes), f"x RAM {_size(ram)}"
    if total_expert_bytes > DIRECT_RAM_RATIO * ram and sys.platform.startswith("linux"):
        return "direct", (
            f"auto: experts {experts} > {DIRECT_RAM_RATIO} {of_ram}: the page cache could hold "
            "too few of them to pay for itself"
        )
    if total_expert_bytes > RAM_FRACTION * ram:
        return "pread", f"auto: experts {experts} > {RAM_FRACTION} {of_ram}"
    return "mmap", f"auto: experts {experts} <= {RAM_FRACTION} {of_ram}"


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def select_expert_io(total_expert_bytes: int, requested: Optional[str] = None) -> str:
    """The RAM gate's mode (``choose_expert_io``), logged once per model size and choice.

    Args:
        total_expert_bytes: the model's expert bytes.
        requested: as ``choose_expert_io``'s.

    Returns:
        ``mmap``, ``pread`` or ``direct``.
    """
    mode, why = choose_expert_io(total_expert_bytes, requested)
    key = (total_expert_bytes, mode, why)
    if key not in _gate_logged:
        _gate_logged.add(key)
        log.info("expert I/O: %s (%s)", mode, why)
    return mode


class ExpertStore:
    """Reads experts of any MoE layer into host staging memory, in parallel for pread.

    Faults: a failed read raises ``ExpertReadError`` from the ``read`` call that needed it (a
    worker's exception is re-raised in the caller, after every other read of that call has
    finished); nothing is cached from a failed call, so the next call simply reads again. An
    interrupt (``KeyboardInterrupt``) while reads are in flight cancels the shares not begun,
    stops the others at their next piece and retires the staging buffer they write into, so a
    straggler cannot corrupt a later call.

    Damage: where ``convert`` recorded each blob's CRC-32 (a converted directory), each expert
    read whole (``read``, ``read_one``) is checked against it the first time it is read, and
    never again (a bitmap per layer of the experts checked; a layer whose every expert is
    checked costs one dict lookup a call). A mismatch raises ``ExpertChecksumError`` naming the
    file, layer and expert, before the bytes are used. Not checked: plain mlx-lm checkpoints (no
    checksums), a part of every expert (tensor parallelism) and ``read_range``'s pieces."""

    def __init__(
        self,
        layers: Dict[int, Source],
        io_mode: str,
        threads: int = 8,
        warm_threads: int = DEFAULT_WARM_READ_THREADS,
        checksums: Optional[Mapping[int, np.ndarray]] = None,
    ):
        self.layers = layers  # layer -> PackedLayer | SafetensorsLayer | ShardedLayer
        self.io_mode = io_mode
        # layer -> the CRC-32 convert recorded per expert (whole-blob layers only)
        self._checksums: Dict[int, np.ndarray] = {
            i: np.asarray(c, np.uint32)
            for i, c in (checksums or {}).items()
            if i in layers and not isinstance(layers[i], ShardedLayer)
        }
        # layer -> which experts have been checked; a layer leaves once all of them have
        self._unchecked: Dict[int, np.ndarray] = {
            i: np.zeros(c.size, bool) for i, c in self._checksums.items()
        }
        # what the checks have cost since the store opened: seconds computing and comparing
        # CRC-32s, bytes checked (written by _check only, under _lock: the whole-layer fill
        # thread and the miss server's read-ahead threads check too; checksum_cost reads the pair)
        self.checksum_s = 0.0
        self.checksum_bytes = 0
        if io_mode != "mmap":  # scattered reads of pieces (mmap keeps readahead: warm reuse)
            for src in layers.values():
                for path, fd in src.file_descriptors().items():
                    advise_random_reads(fd, f"{path} (layer {src.layer})")
        # direct: each expert file's uncached descriptor, by its ordinary one; written here and
        # emptied by close() only
        self._uncached: Dict[int, UncachedFile] = {}
        if io_mode == "direct":
            try:
                self._open_uncached()
            except BaseException:  # the store owns the layers from here: leave nothing open
                for f in self._uncached.values():
                    f.close()
                for src in layers.values():
                    src.close()
                raise
        self.threads = threads
        self.warm_threads = warm_threads  # 0: never fewer than ``threads``
        # False once the kernel or file system refuses a probe (written by the read path only)
        self._probe_cache = _RWF_NOWAIT is not None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._staging: Optional[np.ndarray] = None
        self._lock = threading.Lock()
        self.closed = False

    def _open_uncached(self) -> None:
        cached: List[str] = []
        for src in self.layers.values():
            if isinstance(src, ShardedLayer):  # runs of rows: read through the page cache
                cached += [f"{p}: a part of each expert" for p in src.file_descriptors()]
                continue
            for path, fd in src.file_descriptors().items():
                if fd in self._uncached:
                    continue
                got, why = open_uncached(path, fd)
                if got is None:
                    cached.append(f"{path}: {why}")
                else:
                    self._uncached[fd] = got
        if cached:
            log.warning(
                "expert I/O direct: %d expert file(s) are read through the page cache instead "
                "(%s%s)",
                len(cached),
                cached[0],
                ", ..." if len(cached) > 1 else "",
            )

    def _source(self, layer: int):
        try:
            return self.layers[layer]
        except KeyError:
            raise LayoutError(
                f"layer {layer} has no routed experts in this checkpoint "
                f"(MoE layers: {sorted(self.layers)})"
            ) from None

    def layout(self, layer: int) -> ExpertLayout:
        return self._source(layer).layout

    def component_runs(self, layer: int) -> Optional[List[Tuple[Path, int, int]]]:
        """Where each of ``layer``'s expert components lies in its file: (file, offset of expert
        0's bytes, stride between experts) per component; None where a component is not one
        run per expert (a tensor-parallel part of every expert)."""
        runs = getattr(self._source(layer), "component_runs", None)
        return runs() if runs is not None else None

    def check_experts(self, layer: int, experts: np.ndarray) -> None:
        n = self._source(layer).layout.num_experts
        experts = np.asarray(experts)
        if experts.size and not np.issubdtype(experts.dtype, np.integer):
            raise ExpertIndexError(
                f"layer {layer}: expert indices must be integers, got {experts.dtype}"
            )
        if experts.size and (experts.min() < 0 or experts.max() >= n):
            bad = experts[(experts < 0) | (experts >= n)]
            raise ExpertIndexError(
                f"layer {layer}: expert index {int(bad.flat[0])} out of range "
                f"(the layer has {n} experts, 0..{n - 1})"
            )

    def staging(self, layer: int, n: int) -> np.ndarray:
        """A ``[n, blob_size]`` host buffer for one read.

        One buffer serves every layer: a layer's blobs are consumed (copied into MLX memory)
        before the next layer reads. Requests over ``STAGING_KEEP_BYTES`` (a prefill routing
        most experts) get a buffer of their own that is not kept."""
        size = self.layout(layer).blob_size
        nbytes = max(n, 1) * size
        if nbytes > STAGING_KEEP_BYTES:
            return aligned_empty(n * size).reshape(n, size)
        if self._staging is None or self._staging.size < nbytes:
            self._staging = aligned_empty(nbytes)  # whole pages: uncached reads go in place
        return self._staging[: n * size].reshape(n, size)

    def read(
        self,
        layer: int,
        experts: np.ndarray,
        out: Optional[np.ndarray] = None,
        whole: bool = False,
    ) -> np.ndarray:
        """Blobs of ``experts`` (sorted, unique) of ``layer`` as ``[n, blob_size]`` uint8.

        Args:
            layer: the decoder layer.
            experts: expert indices.
            out: where to read them (default: the store's staging buffer).
            whole: a prefill's whole layer: read on every thread whatever the I/O mode (``mmap``
                too: one thread copying out of a mapping moves a tenth of what 16 preads do).

        Returns:
            The blobs.

        Raises:
            ExpertReadError: a read failed or a file ends first.
            ExpertIndexError: an index the layer does not have.
            ExpertChecksumError: an expert read for the first time is not what convert wrote.
        """
        if self.closed:
            raise ModelClosedError("the expert store is closed; load the model again")
        self.check_experts(layer, experts)
        src = self._source(layer)
        staged = out is None
        if out is None:
            out = self.staging(layer, len(experts))
        if self.io_mode == "mmap" and not (whole and self.threads > 1):
            src.read_mmap(experts, out)
        elif not self._uncached and (
            self.threads <= 1 or (len(experts) == 1 and out.shape[1] <= READ_PIECE_BYTES)
        ):
            src.read_pread(experts, out)
        else:
            self._read_parallel(layer, src, experts, out, staged)
        if layer in self._unchecked:  # the first reads of a converted layer's experts
            self._check(layer, np.asarray(experts).reshape(-1), out)
        return out

    def _check(self, layer: int, experts: np.ndarray, blobs: np.ndarray) -> None:
        """Check the experts of ``layer`` read for the first time against their recorded
        CRC-32; mark them checked; add the time taken and the bytes checked to ``checksum_s``
        and ``checksum_bytes`` (a call that raises adds nothing).

        Raises:
            ExpertChecksumError: one's bytes are not those convert wrote.
        """
        checked = self._unchecked.get(layer)
        if checked is None:
            return
        todo = np.flatnonzero(~checked[experts])
        if not todo.size:
            return
        want = self._checksums[layer]
        t0 = time.perf_counter()
        for i in todo:
            e = int(experts[i])
            got = zlib.crc32(blobs[i])
            if got != int(want[e]):
                path = getattr(self.layers[layer], "path", None)
                raise ExpertChecksumError(
                    f"{path}: layer {layer}, expert {e}: the bytes read are not those convert "
                    f"wrote (CRC-32 {got:08x}, recorded {int(want[e]):08x}): the file is "
                    "damaged; run `moeflux-mlx convert SRC DST` over this directory again to "
                    "rewrite it"
                )
            checked[e] = True
        with self._lock:
            self.checksum_s += time.perf_counter() - t0
            self.checksum_bytes += int(todo.size) * blobs[0].nbytes
        if checked.all():
            self._unchecked.pop(layer, None)

    def check_layer(self, layer: int, blobs: np.ndarray) -> None:
        """Check every expert of ``layer`` not checked yet against its recorded CRC-32, in
        ``blobs`` (the layer's ``[n, blob_size]`` bytes as they lie, e.g. a mapping of its
        packed file): what the GPU copies straight out of the files (``pin_experts``) is never
        read through the store. Safe from several threads for different layers.

        Raises:
            ExpertChecksumError: one's bytes are not those convert wrote.
        """
        if layer in self._unchecked:
            self._check(layer, np.arange(len(blobs)), blobs)

    def checksum_cost(self) -> Tuple[float, int]:
        """``(checksum_s, checksum_bytes)``: what the first-read checks have cost so far."""
        with self._lock:
            return self.checksum_s, self.checksum_bytes

    def read_one(self, layer: int, e: int, out: np.ndarray) -> None:
        """Expert ``e`` of ``layer`` into ``out`` (``[blob_size]`` uint8), in the calling thread,
        as this store reads (uncached in ``direct`` mode): for background reads.

        Raises:
            ExpertReadError: a read failed or a file ends first.
            ExpertChecksumError: the expert's bytes are not those convert wrote (checked at
                its first read only).
        """
        src = self._source(layer)
        if not self._uncached or isinstance(src, ShardedLayer):
            src.read_one(e, out)
        else:
            for fd, start, at, n, what in src.pieces(e):
                self.read_range(fd, start, out[at : at + n], what)
        if layer in self._unchecked:
            self._check(layer, np.array([e]), out.reshape(1, -1))

    def read_range(self, fd: int, start: int, into: np.ndarray, what: str) -> None:
        """One contiguous range of an expert file as this store's reads go (uncached in
        ``direct`` mode), in the calling thread.

        Args:
            fd: the file's descriptor, as the layer's ``pieces`` name it.
            start: the file offset.
            into: a 1-d contiguous uint8 array to fill.
            what: names the file, layer and expert in an error.

        Raises:
            ExpertReadError: the read failed or the file ends first.
        """
        if self.closed:
            raise ModelClosedError("the expert store is closed; load the model again")
        reader = self._uncached.get(fd)
        if reader is not None:
            reader.read(start, into, what)
        else:
            readers.read_exact(fd, start, memoryview(into), what)

    def _read_parallel(self, layer, src, experts, out, staged) -> None:
        pool = self._executor()
        futures: List[Future] = []
        stop = threading.Event()
        try:
            if isinstance(src, ShardedLayer):  # runs of rows: a job per piece, as they come
                shares = [[job] for i, e in enumerate(experts) for job in src.jobs(e, out[i])]
            else:
                reads = [
                    (self._uncached.get(fd, fd), start, out[i, at : at + n], what)
                    for i, e in enumerate(experts)
                    for fd, start, at, n, what in src.pieces(e)
                ]
                shares = balanced_shares(reads, self._threads_for(reads))
            for share in shares:
                futures.append(pool.submit(_run_jobs, share, stop))
            errors = [f.exception() for f in futures]  # waits for every read of this call
        except BaseException:
            # interrupted (KeyboardInterrupt, ...) while reads are in flight: shares not begun
            # are cancelled, those under way stop at their next piece
            stop.set()
            for f in futures:
                f.cancel()
            if staged:
                self._staging = None  # a straggler may still write into it: never reuse
            try:
                wait(futures, timeout=10)
            except BaseException:  # noqa: BLE001 - the interruption already under way is raised below
                pass
            raise
        for err in errors:
            if err is not None:
                raise err

    def _threads_for(self, reads: List[tuple]) -> int:
        """The threads a call's reads are dealt to: ``warm_threads`` for a small call the page
        cache holds, else every thread."""
        if (
            not 0 < self.warm_threads < self.threads
            or not self._probe_cache
            or sum(len(into) for _, _, into, _ in reads) > WARM_PROBE_MAX_BYTES
            or any(not isinstance(fd, int) for fd, _, _, _ in reads)  # uncached: no page cache
        ):
            return self.threads
        held = page_cache_holds(reads)
        if held is None:  # probes refused here: never ask again
            self._probe_cache = False
        return self.warm_threads if held else self.threads

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self.closed:
                raise ModelClosedError("the expert store is closed; load the model again")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moeflux-read")
            return self._pool

    def spec(self) -> dict:
        """What ``store_from_spec`` needs to open the same experts in another process."""
        layers = {}
        for i, src in self.layers.items():
            d: Dict[str, object] = {"layout": src.layout.to_dict()}
            if isinstance(src, ShardedLayer):
                raise LayoutError(
                    f"layer {i}: a part of its experts (tensor parallelism) is not opened again "
                    "in another process"
                )
            if isinstance(src, PackedLayer):
                d["file"] = str(src.path)
                if i in self._checksums:
                    d["checksums"] = blob_sums.encode(self._checksums[i])
            else:
                d["ranges"] = {
                    c.name: {
                        "file": str(r.file),
                        "dtype": r.dtype,
                        "shape": list(r.shape),
                        "start": r.start,
                        "nbytes": r.nbytes,
                    }
                    for c, r in src.parts
                }
            layers[str(i)] = d
        return {
            "io_mode": self.io_mode,
            "threads": self.threads,
            "warm_threads": self.warm_threads,
            "layers": layers,
        }

    def close(self) -> None:
        """Join the read threads, unmap and close every file. Idempotent."""
        with self._lock:
            self.closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for src in self.layers.values():
            src.close()
        for f in self._uncached.values():
            f.close()
        self._uncached = {}
        self._staging = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_store(
    path: Path,
    io_mode: Optional[str] = None,
    threads: int = 8,
    shards: Optional[Mapping[int, Optional[ExpertShard]]] = None,
    warm_threads: int = DEFAULT_WARM_READ_THREADS,
) -> Tuple[ExpertStore, ModelLayout]:
    """Open the experts of a converted directory or a plain mlx-lm checkpoint.

    Everything that can be checked from headers and file sizes is checked here, before any
    weight is read (see docs/errors.md).

    Args:
        path: the model directory.
        io_mode: ``auto`` (the RAM gate), ``mmap``, ``pread`` or ``direct``; None:
            ``MOEFLUX_EXPERT_IO`` or auto.
        threads: parallel reads of the ``pread`` store.
        shards: one process's share of a distributed model: only these layers are opened, each
            whole (None) or a part of every expert (``ExpertLayout.shard``); the RAM gate and the
            returned layout are the share's. None: every layer, whole.
        warm_threads: the threads of a small read the page cache holds (0: ``threads``).

    Returns:
        ``(store, model_layout)``.

    Raises:
        CheckpointError: not a usable MoE checkpoint (``LayoutError``, ``SafetensorsHeaderError``...).
        ExpertFileError: an expert file is missing, unreadable or of the wrong size.
    """
    path = Path(path)
    make: Callable[[int, ExpertLayout], LayerSource]
    recorded = None  # plain checkpoints record no checksums: nothing to check against
    if is_packed(path):
        model_layout = check_packed(path)
        recorded = blob_sums.read_recorded(path / PACKED_DIR / LAYOUT_FILE, model_layout)
        make = lambda i, lay: PackedLayer(i, lay, packed_file(path, i))
    else:
        ckpt = scan_checkpoint(path)
        model_layout = ckpt.layout
        make = lambda i, lay: SafetensorsLayer(i, lay, ckpt.ranges[i])
    wanted = sorted(model_layout.layers if shards is None else shards)
    missing = [i for i in wanted if i not in model_layout.layers]
    if missing:
        raise LayoutError(f"{path}: no routed experts in layers {missing}")
    layers: Dict[int, Source] = {}
    try:
        for i in wanted:
            src = layers[i] = make(i, model_layout.layers[i])
            shard = shards.get(i) if shards is not None else None
            if shard is not None:
                layers[i] = ShardedLayer(src, shard)
    except BaseException:
        for opened in layers.values():
            opened.close()
        raise
    if shards is not None:
        paths = model_layout.module_paths
        model_layout = ModelLayout(
            {i: src.layout for i, src in layers.items()}, {i: paths[i] for i in layers}
        )
    mode = select_expert_io(model_layout.total_expert_bytes, io_mode)
    return ExpertStore(layers, mode, threads, warm_threads, recorded), model_layout


def _chunks(
    fd: Union[int, UncachedFile],
    start: int,
    into: np.ndarray,
    what: str,
    piece: int = READ_PIECE_BYTES,
) -> List[tuple]:
    """Read jobs for the contiguous bytes at ``start`` of a file (a descriptor, or its uncached
    reader) that fill ``into``, in pieces of at most ``piece`` bytes (for the read threads)."""
    n = len(into)
    if isinstance(fd, UncachedFile):
        return [(fd.read, start + off, into[off : off + piece], what) for off in range(0, n, piece)]
    return [
        (readers.read_exact, fd, start + off, memoryview(into[off : off + piece]), what)
        for off in range(0, n, piece)
    ]


def piece_bytes(share: int) -> int:
    """The pieces a share of ``share`` bytes is read in: ``READ_PIECE_BYTES``, or for a large
    share ``PIECES_PER_SHARE`` pieces (page multiples)."""
    larger = -(-share // PIECES_PER_SHARE // PAGE_BYTES) * PAGE_BYTES
    return max(READ_PIECE_BYTES, larger)


def page_cache_holds(reads: List[tuple]) -> Optional[bool]:
    """Whether the page cache holds ``reads``, judged by the first, middle and last page of
    each, asked with ``RWF_NOWAIT`` one-byte reads that never wait for the disk.

    Args:
        reads: ``(fd, file offset, 1-d uint8 array to fill, what)`` per contiguous read, as
            ``balanced_shares`` takes them; only their places are used, nothing is filled.

    Returns:
        True if every page probed is cached, False if one is not; None where the kernel or the
        file system cannot answer (no ``RWF_NOWAIT``, or a probe refused).
    """
    if _RWF_NOWAIT is None:
        return None
    byte = bytearray(1)
    for fd, start, into, _ in reads:
        n = len(into)
        for at in sorted({0, n // 2, n - 1} if n else set()):
            try:
                if os.preadv(fd, [byte], start + at, _RWF_NOWAIT) != 1:
                    return False  # past the end: the read itself will say so
            except BlockingIOError:
                return False
            except OSError as e:  # refused (an old kernel, a file system without it), or a
                # failing page, which the read itself then meets and reports
                return None if e.errno in _PROBE_REFUSED else False
    return True


def balanced_shares(reads: List[tuple], threads: int) -> List[List[tuple]]:
    """One call's contiguous reads ``(fd, start, into, what)`` dealt into at most ``threads``
    shares of equal bytes (page multiples, at least ``MIN_SHARE_BYTES``), in order: a share is
    the ``read_exact`` jobs, each at most ``piece_bytes(share)``, that one thread runs in turn. A
    read may be split between two shares.

    Args:
        reads: ``(fd, file offset, 1-d uint8 array to fill, what)`` per contiguous read; ``fd``
            may be an ``UncachedFile``.
        threads: the read threads.

    Returns:
        The shares, every byte of every read in exactly one job.
    """
    total = sum(len(into) for _, _, into, _ in reads)
    n = max(1, min(threads, total // MIN_SHARE_BYTES))
    size = -(-total // n)
    size = -(-size // PAGE_BYTES) * PAGE_BYTES
    piece = piece_bytes(size)
    shares: List[List[tuple]] = []
    share: List[tuple] = []
    room = size
    for fd, start, into, what in reads:
        at = 0
        while at < len(into):
            k = min(room, len(into) - at)
            share += _chunks(fd, start + at, into[at : at + k], what, piece)
            at, room = at + k, room - k
            if room == 0:
                shares.append(share)
                share, room = [], size
    if share:
        shares.append(share)
    return shares


def _run_jobs(jobs: List[tuple], stop: Optional[threading.Event] = None) -> None:
    """One thread's share of a call, in turn; none begins once ``stop`` is set."""
    for fn, *args in jobs:
        if stop is not None and stop.is_set():
            return
        fn(*args)


def read_runs(fd: int, start: int, stride: int, into: np.ndarray, what: str) -> None:
    """Read runs a ``stride`` apart from ``start`` into the rows of ``into`` (``[count, run]``).

    Runs closer than ``SKIP_GAP_BYTES`` are read as one span, gaps included, into a buffer of
    this call's own, and copied out: the disk reads every page of such a span whichever bytes
    of it are kept, and a Python object per row (``preadv``'s buffers) cost more than the read
    (docs/distributed.md). Longer gaps are skipped, one read per run.

    Raises:
        ExpertReadError: a read failed or came short of the file's end.
    """
    count, run = into.shape
    gap = stride - run
    if count == 1 or gap == 0:
        readers.read_exact(fd, start, memoryview(into.reshape(-1)), what)
        return
    if gap < 0 or gap >= SKIP_GAP_BYTES:
        for k in range(count):
            readers.read_exact(fd, start + k * stride, memoryview(into[k]), what)
        return
    span = np.empty(count * stride, np.uint8)  # per call: the read threads share nothing
    readers.read_exact(fd, start, memoryview(span[: count * stride - gap]), what)
    into[:] = span.reshape(count, stride)[:, :run]


class ShardedLayer:
    """A part of every expert of one layer (``ExpertShard``: e.g. one process's half of a
    tensor-parallel pair), read from the layer's own source: only the spans of each full blob
    that the part keeps, into blobs of the part's layout. The same reads as the sources offer
    (``read_one``, ``read_pread``, ``read_mmap``, ``jobs`` for the read threads)."""

    def __init__(self, source: LayerSource, shard: ExpertShard):
        self.source, self.layer = source, source.layer
        self.layout, self.spans = shard.layout, shard.spans
        self._maps: Dict[int, readers._Mapping] = {}
        # the file bytes the last expert (the furthest in every file) needs, per descriptor
        self._need: Dict[int, int] = {}
        for s, fd, off, _ in self._located(source.layout.num_experts - 1):
            self._need[fd] = max(self._need.get(fd, 0), off + s.end - s.src)

    def _located(self, e: int) -> List[Tuple[Span, int, int, str]]:
        """``(span, fd, file offset of the span's first byte, what)`` for expert ``e``."""
        pieces = self.source.pieces(e)
        out = []
        for s in self.spans:
            found = [p for p in pieces if p[2] <= s.src and s.end <= p[2] + p[3]]
            if not found:
                raise LayoutError(f"layer {self.layer}: a part's span {s} lies outside the blob")
            fd, start, at, _, what = found[0]
            out.append((s, fd, start + s.src - at, what))
        return out

    @staticmethod
    def _into(s: Span, row: np.ndarray) -> np.ndarray:
        return row[s.dst : s.dst + s.count * s.nbytes].reshape(s.count, s.nbytes)

    def read_one(self, e: int, out: np.ndarray) -> None:
        for s, fd, off, what in self._located(e):
            read_runs(fd, off, s.stride, self._into(s, out), what)

    def read_pread(self, experts, out: np.ndarray) -> None:
        for i, e in enumerate(experts):
            self.read_one(e, out[i])

    def jobs(self, e: int, row: np.ndarray) -> List[tuple]:
        """Reads of expert ``e`` into ``row`` for the read threads, each about
        ``READ_PIECE_BYTES`` of the file or less."""
        out: List[tuple] = []
        for s, fd, off, what in self._located(e):
            into = self._into(s, row)
            if s.count == 1:
                out += _chunks(fd, off, into.reshape(-1), what)
                continue
            step = max(1, READ_PIECE_BYTES // s.stride)
            out += [
                (
                    read_runs,
                    fd,
                    off + k * s.stride,
                    s.stride,
                    into[k : k + step],
                    what,
                )
                for k in range(0, s.count, step)
            ]
        return out

    def read_mmap(self, experts, out: np.ndarray) -> None:
        for i, e in enumerate(experts):
            for s, fd, off, what in self._located(e):
                m = self._maps.get(fd)
                readers._check_mapped(fd, self._need[fd], what)
                if m is None:
                    m = self._maps[fd] = readers._Mapping(fd, what)
                if m.size < self._need[fd]:
                    raise ExpertReadError(f"{what}: mapped {m.size} bytes, {self._need[fd]} needed")
                runs = np.lib.stride_tricks.as_strided(
                    m.array[off:], (s.count, s.nbytes), (s.stride, 1), writeable=False
                )
                self._into(s, out[i])[:] = runs

    def file_descriptors(self) -> Dict[Path, int]:
        return self.source.file_descriptors()

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        self.source.close()


Source = Union[LayerSource, ShardedLayer]  # what the store reads one layer's experts from


def store_from_spec(spec: dict) -> ExpertStore:
    """The store ``ExpertStore.spec()`` describes (opened again, e.g. in the miss server)."""
    layers: Dict[int, Source] = {}
    sums: Dict[int, np.ndarray] = {}
    try:
        for k, d in spec["layers"].items():
            i = int(k)
            layout = ExpertLayout.from_dict(d["layout"], f"layer {i}")
            if "file" in d:
                layers[i] = PackedLayer(i, layout, Path(d["file"]))
                if "checksums" in d:
                    sums[i] = np.frombuffer(bytes.fromhex(d["checksums"]), ">u4")
            else:
                ranges = {
                    name: TensorRange(
                        Path(r["file"]),
                        r["dtype"],
                        tuple(r["shape"]),
                        int(r["start"]),
                        int(r["nbytes"]),
                    )
                    for name, r in d["ranges"].items()
                }
                layers[i] = SafetensorsLayer(i, layout, ranges)
    except BaseException:
        for src in layers.values():
            src.close()
        raise
    return ExpertStore(
        layers, spec["io_mode"], int(spec["threads"]), int(spec["warm_threads"]), sums
    )
