"""The expert store: reads the blobs of routed experts from disk into host memory.

Two sources describe where one layer's experts lie: ``PackedLayer`` (a converted
``layer_NN.bin``, one contiguous read per expert) and ``SafetensorsLayer`` (a plain mlx-lm
checkpoint: each expert is a slice of every stacked tensor, one read per component). Both produce
the same blob bytes. Two I/O modes read them: ``pread`` into reusable staging buffers (the GIL is
released while the kernel copies) or copies out of an ``mmap`` of the same files; the RAM gate
chooses between them.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import psutil

from .errors import (ExpertFileError, ExpertIndexError, ExpertReadError, LayoutError,
                     ModelClosedError)
from .layout import ExpertLayout
from .safetensors_index import TensorRange, open_readonly

log = logging.getLogger(__name__)

IO_MODES = ("auto", "mmap", "pread")
RAM_FRACTION = 0.75
STAGING_KEEP_BYTES = 256 << 20  # larger reads (prefill) get a buffer of their own, not kept
# Reads are split into pieces of at most this size across the read threads: one expert read
# as a single pread is latency-bound on a cold disk (a VM disk at 1.6 GB/s with 8 threads
# delivered about 1 GB/s to single 2.6 MB reads).
READ_PIECE_BYTES = 512 << 10
_gate_logged = set()


def advise_random_reads(fd: int, what: str) -> None:
    """Turn the kernel's readahead off for ``fd``. The pieces of one expert, read in parallel,
    look like a sequential stream to it, and it reads on past the expert: on a disk with 8 MiB
    readahead, 3x the bytes and 2-3x the time per batch of misses through the store
    (benchmarks/results/2026-11-23-cpu2-read-probe-advice.txt). Only a hint: failure is ignored."""
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        elif sys.platform == "darwin":  # no posix_fadvise on macOS: fcntl(F_RDAHEAD, 0)
            import fcntl
            fcntl.fcntl(fd, getattr(fcntl, "F_RDAHEAD", 45), 0)
    except OSError as e:
        log.debug("%s: could not turn readahead off: %s", what, e)


def read_exact(fd: int, start: int, into: memoryview, what: str) -> None:
    """pread exactly ``len(into)`` bytes at ``start``; retry short reads, fail clearly at EOF."""
    n, done = len(into), 0
    while done < n:
        try:
            got = os.preadv(fd, [into[done:]], start + done)
        except OSError as e:
            raise ExpertReadError(f"{what}: read of {n} bytes at offset {start} failed: {e}") from e
        if got == 0:
            raise ExpertReadError(f"{what}: short read, {done} of {n} bytes at offset {start} "
                                  "(file truncated?)")
        done += got


def select_expert_io(total_expert_bytes: int, requested: Optional[str] = None) -> str:
    """The RAM gate: ``pread`` when the experts exceed 0.75 x physical RAM, else ``mmap``.

    ``requested`` (the ``expert_io=`` argument) or ``MOEFLUX_EXPERT_IO`` override it."""
    ram = psutil.virtual_memory().total
    choice = requested or os.environ.get("MOEFLUX_EXPERT_IO") or "auto"
    if choice not in IO_MODES:
        log.warning("unknown expert I/O mode %r (MOEFLUX_EXPERT_IO / expert_io); using auto; "
                    "choose one of %s", choice, ", ".join(IO_MODES))
        choice = "auto"
    if choice == "auto":
        mode = "pread" if total_expert_bytes > RAM_FRACTION * ram else "mmap"
        why = (f"experts {total_expert_bytes / 1e9:.2f} GB {'>' if mode == 'pread' else '<='} "
               f"{RAM_FRACTION} x RAM {ram / 1e9:.2f} GB")
    else:
        mode, why = choice, "requested"
    key = (total_expert_bytes, mode, why)
    if key not in _gate_logged:
        _gate_logged.add(key)
        log.info("expert I/O: %s (%s)", mode, why)
    return mode


class _Mapping:
    """A read-only map of a whole file, closed explicitly (it holds a duplicate of the fd)."""

    def __init__(self, fd: int, what: str):
        try:
            self.mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            raise ExpertReadError(f"{what}: cannot map the file: {e}") from e
        self.array = np.frombuffer(self.mm, np.uint8)
        self.size = len(self.mm)

    def close(self) -> None:
        self.array = None
        try:
            self.mm.close()
        except BufferError:  # a view of it is still alive somewhere: the GC closes it later
            pass


def _check_mapped(fd: int, need: int, what: str) -> None:
    """Touching a mapped page past the end of the file kills the process with SIGBUS. The file
    may have been truncated since it was opened, so check its size (one fstat, about 1 us)
    before every mapped read; raise instead of crashing."""
    try:
        size = os.fstat(fd).st_size
    except OSError as e:
        raise ExpertReadError(f"{what}: cannot stat the file: {e}") from e
    if size < need:
        raise ExpertReadError(f"{what}: the file shrank to {size} bytes since it was opened "
                              f"({need} needed); truncated or rewritten while in use?")


class PackedLayer:
    """One converted layer file: expert ``e`` is bytes ``[e*S, (e+1)*S)``."""

    def __init__(self, layer: int, layout: ExpertLayout, path: Path):
        self.layer, self.layout, self.path = layer, layout, Path(path)
        self.fd = open_readonly(self.path, f"packed experts of layer {layer}")
        try:
            size = os.fstat(self.fd).st_size
        except OSError as e:
            os.close(self.fd)
            raise ExpertFileError(f"{self.path}: cannot stat (layer {layer}): {e}") from e
        if size != layout.layer_bytes:
            os.close(self.fd)
            raise ExpertFileError(
                f"{self.path}: {size} bytes, but the layout says layer {layer} holds "
                f"{layout.num_experts} experts x {layout.blob_size} = {layout.layer_bytes} bytes "
                f"({'truncated' if size < layout.layer_bytes else 'wrong file or layout'}?)")
        self._map: Optional[_Mapping] = None

    def _what(self, e: int) -> str:
        return f"{self.path} (layer {self.layer}, expert {int(e)})"

    def read_pread(self, experts: Sequence[int], out: np.ndarray) -> None:
        for i, e in enumerate(experts):
            self.read_one(e, out[i])

    def read_one(self, e: int, out: np.ndarray) -> None:
        read_exact(self.fd, int(e) * self.layout.blob_size, memoryview(out), self._what(e))

    def file_descriptors(self) -> Dict[Path, int]:
        return {self.path: self.fd}

    def pieces(self, e: int):
        """(fd, file offset, blob offset, bytes, what) of expert ``e``'s bytes."""
        return [(self.fd, int(e) * self.layout.blob_size, 0, self.layout.blob_size, self._what(e))]

    def read_mmap(self, experts: Sequence[int], out: np.ndarray) -> None:
        what = f"{self.path} (layer {self.layer})"
        _check_mapped(self.fd, self.layout.layer_bytes, what)
        if self._map is None:
            self._map = _Mapping(self.fd, what)
        if self._map.size < self.layout.layer_bytes:  # mapped while shorter: never read past it
            raise ExpertReadError(f"{what}: mapped {self._map.size} bytes, "
                                  f"{self.layout.layer_bytes} needed")
        view = self._map.array.reshape(self.layout.num_experts, -1)
        try:
            np.take(view, experts, axis=0, out=out)
        except (OSError, ValueError, IndexError) as e:
            raise ExpertReadError(f"{what}: mapped read of experts {list(experts)} failed: {e}") from e

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SafetensorsLayer:
    """One layer's experts inside the stacked tensors of a plain mlx-lm checkpoint."""

    def __init__(self, layer: int, layout: ExpertLayout, ranges: Dict[str, TensorRange]):
        self.layer, self.layout = layer, layout
        self.parts = [(c, ranges[c.name]) for c in layout.components]
        self.fds: Dict[Path, int] = {}
        self._maps: Dict[Path, _Mapping] = {}
        # the end of the last expert byte needed in each file
        self._need: Dict[Path, int] = {}
        for _, r in self.parts:
            self._need[r.file] = max(self._need.get(r.file, 0), r.start + r.nbytes)
        try:
            for _, r in self.parts:
                if r.file not in self.fds:
                    self.fds[r.file] = open_readonly(r.file, f"experts of layer {layer}")
                    size = os.fstat(self.fds[r.file]).st_size
                    if size < self._need[r.file]:
                        raise ExpertFileError(
                            f"{r.file}: {size} bytes, but layer {layer}'s experts end at byte "
                            f"{self._need[r.file]} (truncated?)")
        except BaseException:
            self.close()
            raise

    def read_one(self, e: int, out: np.ndarray) -> None:
        for fd, start, at, n, what in self.pieces(e):
            read_exact(fd, start, memoryview(out[at:at + n]), what)

    def file_descriptors(self) -> Dict[Path, int]:
        return dict(self.fds)

    def pieces(self, e: int):
        return [(self.fds[r.file], r.start + int(e) * c.nbytes, c.offset, c.nbytes,
                 f"{r.file} (layer {self.layer}, expert {int(e)}, {c.name})") for c, r in self.parts]

    def read_pread(self, experts: Sequence[int], out: np.ndarray) -> None:
        for i, e in enumerate(experts):
            self.read_one(e, out[i])

    def read_mmap(self, experts: Sequence[int], out: np.ndarray) -> None:
        for f, fd in self.fds.items():
            _check_mapped(fd, self._need[f], f"{f} (layer {self.layer})")
        idx = np.asarray(experts)
        for c, r in self.parts:
            m = self._maps.get(r.file)
            if m is None:
                m = self._maps[r.file] = _Mapping(self.fds[r.file], f"{r.file} (layer {self.layer})")
            if m.size < r.start + r.nbytes:
                raise ExpertReadError(f"{r.file} (layer {self.layer}): mapped {m.size} bytes, "
                                      f"{r.start + r.nbytes} needed")
            stacked = m.array[r.start:r.start + r.nbytes].reshape(-1, c.nbytes)
            out[:, c.offset:c.offset + c.nbytes] = stacked[idx]

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class ExpertStore:
    """Reads experts of any MoE layer into host staging memory, in parallel for pread.

    Faults: a failed read raises ``ExpertReadError`` from the ``read`` call that needed it (a
    worker's exception is re-raised in the caller, after every other read of that call has
    finished); nothing is cached from a failed call, so the next call simply reads again. An
    interrupt (``KeyboardInterrupt``) while reads are in flight cancels the queued ones and
    retires the staging buffer they write into, so a straggler cannot corrupt a later call."""

    def __init__(self, layers: Dict[int, object], io_mode: str, threads: int = 8):
        self.layers = layers  # layer -> PackedLayer | SafetensorsLayer
        self.io_mode = io_mode
        if io_mode == "pread":  # scattered reads of pieces (mmap keeps readahead: warm reuse)
            for src in layers.values():
                for path, fd in src.file_descriptors().items():
                    advise_random_reads(fd, f"{path} (layer {src.layer})")
        self.threads = threads
        self._pool: Optional[ThreadPoolExecutor] = None
        self._staging: Optional[np.ndarray] = None
        self._lock = threading.Lock()
        self.closed = False

    def _source(self, layer: int):
        try:
            return self.layers[layer]
        except KeyError:
            raise LayoutError(f"layer {layer} has no routed experts in this checkpoint "
                              f"(MoE layers: {sorted(self.layers)})") from None

    def layout(self, layer: int) -> ExpertLayout:
        return self._source(layer).layout

    def check_experts(self, layer: int, experts: np.ndarray) -> None:
        n = self._source(layer).layout.num_experts
        experts = np.asarray(experts)
        if experts.size and not np.issubdtype(experts.dtype, np.integer):
            raise ExpertIndexError(f"layer {layer}: expert indices must be integers, "
                                   f"got {experts.dtype}")
        if experts.size and (experts.min() < 0 or experts.max() >= n):
            bad = experts[(experts < 0) | (experts >= n)]
            raise ExpertIndexError(f"layer {layer}: expert index {int(bad.flat[0])} out of range "
                                   f"(the layer has {n} experts, 0..{n - 1})")

    def staging(self, layer: int, n: int) -> np.ndarray:
        """A ``[n, blob_size]`` host buffer for one read.

        One buffer serves every layer: a layer's blobs are consumed (copied into MLX memory)
        before the next layer reads. Requests over ``STAGING_KEEP_BYTES`` (a prefill routing
        most experts) get a buffer of their own that is not kept."""
        size = self.layout(layer).blob_size
        nbytes = max(n, 1) * size
        if nbytes > STAGING_KEEP_BYTES:
            return np.empty((n, size), np.uint8)
        if self._staging is None or self._staging.size < nbytes:
            self._staging = np.empty(nbytes, np.uint8)
        return self._staging[:n * size].reshape(n, size)

    def read(self, layer: int, experts: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Blobs of ``experts`` (sorted, unique) of ``layer`` as ``[n, blob_size]`` uint8."""
        if self.closed:
            raise ModelClosedError("the expert store is closed; load the model again")
        self.check_experts(layer, experts)
        src = self._source(layer)
        staged = out is None
        out = self.staging(layer, len(experts)) if staged else out
        if self.io_mode == "mmap":
            src.read_mmap(experts, out)
        elif self.threads <= 1 or (len(experts) == 1 and out.shape[1] <= READ_PIECE_BYTES):
            src.read_pread(experts, out)
        else:
            self._read_parallel(layer, src, experts, out, staged)
        return out

    def _read_parallel(self, layer, src, experts, out, staged) -> None:
        pool = self._executor()
        futures = []
        try:
            for i, e in enumerate(experts):
                for fd, start, at, n, what in src.pieces(e):
                    for off in range(0, n, READ_PIECE_BYTES):
                        m = min(READ_PIECE_BYTES, n - off)
                        futures.append(pool.submit(read_exact, fd, start + off,
                                                   memoryview(out[i, at + off:at + off + m]), what))
            errors = [f.exception() for f in futures]  # waits for every read of this call
        except BaseException:
            # interrupted (KeyboardInterrupt, ...) while reads are in flight
            for f in futures:
                f.cancel()
            if staged:
                self._staging = None  # a straggler may still write into it: never reuse
            try:
                wait(futures, timeout=10)
            except BaseException:
                pass
            raise
        for err in errors:
            if err is not None:
                raise err

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
            d = {"layout": src.layout.to_dict()}
            if isinstance(src, PackedLayer):
                d["file"] = str(src.path)
            else:
                d["ranges"] = {c.name: {"file": str(r.file), "dtype": r.dtype, "shape": list(r.shape),
                                        "start": r.start, "nbytes": r.nbytes} for c, r in src.parts}
            layers[str(i)] = d
        return {"io_mode": self.io_mode, "threads": self.threads, "layers": layers}

    def close(self) -> None:
        """Join the read threads, unmap and close every file. Idempotent."""
        with self._lock:
            self.closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for src in self.layers.values():
            src.close()
        self._staging = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_store(path: Path, io_mode: Optional[str] = None, threads: int = 8) -> tuple:
    """Open the experts of a converted directory or a plain mlx-lm checkpoint.

    Everything that can be checked from headers and file sizes is checked here, before any
    weight is read (see docs/errors.md). Returns ``(store, model_layout)``."""
    from .checkpoint import check_packed, is_packed, packed_file, scan_checkpoint

    path = Path(path)
    if is_packed(path):
        model_layout = check_packed(path)
        make = lambda i, lay: PackedLayer(i, lay, packed_file(path, i))  # noqa: E731
    else:
        ckpt = scan_checkpoint(path)
        model_layout = ckpt.layout
        make = lambda i, lay: SafetensorsLayer(i, lay, ckpt.ranges[i])  # noqa: E731
    layers = {}
    try:
        for i, lay in sorted(model_layout.layers.items()):
            layers[i] = make(i, lay)
    except BaseException:
        for src in layers.values():
            src.close()
        raise
    mode = select_expert_io(model_layout.total_expert_bytes, io_mode)
    return ExpertStore(layers, mode, threads), model_layout


def store_from_spec(spec: dict) -> ExpertStore:
    """The store ``ExpertStore.spec()`` describes (opened again, e.g. in the miss server)."""
    layers = {}
    try:
        for k, d in spec["layers"].items():
            i = int(k)
            layout = ExpertLayout.from_dict(d["layout"], f"layer {i}")
            if "file" in d:
                layers[i] = PackedLayer(i, layout, Path(d["file"]))
            else:
                ranges = {name: TensorRange(Path(r["file"]), r["dtype"], tuple(r["shape"]),
                                            int(r["start"]), int(r["nbytes"]))
                          for name, r in d["ranges"].items()}
                layers[i] = SafetensorsLayer(i, layout, ranges)
    except BaseException:
        for src in layers.values():
            src.close()
        raise
    return ExpertStore(layers, spec["io_mode"], int(spec["threads"]))
