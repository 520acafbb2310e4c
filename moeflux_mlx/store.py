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
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import psutil

from .errors import ExpertFileError, ExpertIndexError, ExpertReadError, ModelClosedError
from .layout import ExpertLayout
from .safetensors_index import TensorRange

log = logging.getLogger(__name__)

IO_MODES = ("auto", "mmap", "pread")
RAM_FRACTION = 0.75
_gate_logged = set()


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


def _open(path: Path, what: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise ExpertFileError(f"{path}: missing ({what})") from e
    except PermissionError as e:
        raise ExpertFileError(f"{path}: not readable ({what}): {e.strerror}") from e
    except OSError as e:
        raise ExpertFileError(f"{path}: cannot open ({what}): {e}") from e


class PackedLayer:
    """One converted layer file: expert ``e`` is bytes ``[e*S, (e+1)*S)``."""

    def __init__(self, layer: int, layout: ExpertLayout, path: Path):
        self.layer, self.layout, self.path = layer, layout, Path(path)
        self.fd = _open(self.path, f"packed experts of layer {layer}")
        size = os.fstat(self.fd).st_size
        if size != layout.layer_bytes:
            os.close(self.fd)
            raise ExpertFileError(
                f"{self.path}: {size} bytes, but the layout says layer {layer} holds "
                f"{layout.num_experts} experts x {layout.blob_size} = {layout.layer_bytes} bytes "
                f"({'truncated' if size < layout.layer_bytes else 'wrong file or layout'}?)")
        self._map: Optional[np.ndarray] = None

    def read_pread(self, experts: Sequence[int], out: np.ndarray) -> None:
        s = self.layout.blob_size
        for i, e in enumerate(experts):
            read_exact(self.fd, int(e) * s, memoryview(out[i]), f"{self.path} (expert {int(e)})")

    def read_one(self, e: int, out: np.ndarray) -> None:
        read_exact(self.fd, int(e) * self.layout.blob_size, memoryview(out),
                   f"{self.path} (expert {int(e)})")

    def read_mmap(self, experts: Sequence[int], out: np.ndarray) -> None:
        if self._map is None:
            mm = mmap.mmap(self.fd, 0, prot=mmap.PROT_READ)
            self._map = np.frombuffer(mm, np.uint8).reshape(self.layout.num_experts, -1)
        try:
            np.take(self._map, experts, axis=0, out=out)
        except (OSError, ValueError) as e:  # SIGBUS-free failures of a mapped read
            raise ExpertReadError(f"{self.path}: mapped read of experts failed: {e}") from e

    def close(self) -> None:
        self._map = None  # the mapping closes when its last view is dropped
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SafetensorsLayer:
    """One layer's experts inside the stacked tensors of a plain mlx-lm checkpoint."""

    def __init__(self, layer: int, layout: ExpertLayout, ranges: Dict[str, TensorRange]):
        self.layer, self.layout = layer, layout
        self.parts = [(c, ranges[c.name]) for c in layout.components]
        self.fds = {}
        try:
            for _, r in self.parts:
                if r.file not in self.fds:
                    self.fds[r.file] = _open(r.file, f"experts of layer {layer}")
        except ExpertFileError:
            self.close()
            raise
        self._maps: Dict[Path, np.ndarray] = {}

    def read_one(self, e: int, out: np.ndarray) -> None:
        for c, r in self.parts:
            read_exact(self.fds[r.file], r.start + int(e) * c.nbytes,
                       memoryview(out[c.offset:c.offset + c.nbytes]),
                       f"{r.file} (layer {self.layer}, expert {int(e)}, {c.name})")

    def read_pread(self, experts: Sequence[int], out: np.ndarray) -> None:
        for i, e in enumerate(experts):
            self.read_one(e, out[i])

    def read_mmap(self, experts: Sequence[int], out: np.ndarray) -> None:
        for c, r in self.parts:
            if r.file not in self._maps:
                mm = mmap.mmap(self.fds[r.file], 0, prot=mmap.PROT_READ)
                self._maps[r.file] = np.frombuffer(mm, np.uint8)
            stacked = self._maps[r.file][r.start:r.start + r.nbytes].reshape(-1, c.nbytes)
            out[:, c.offset:c.offset + c.nbytes] = stacked[np.asarray(experts)]

    def close(self) -> None:
        self._maps.clear()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class ExpertStore:
    """Reads experts of any MoE layer into host staging memory, in parallel for pread."""

    def __init__(self, layers: Dict[int, object], io_mode: str, threads: int = 8):
        self.layers = layers  # layer -> PackedLayer | SafetensorsLayer
        self.io_mode = io_mode
        self.threads = threads
        self._pool: Optional[ThreadPoolExecutor] = None
        self._staging: Dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.closed = False

    def layout(self, layer: int) -> ExpertLayout:
        return self.layers[layer].layout

    def check_experts(self, layer: int, experts: np.ndarray) -> None:
        n = self.layers[layer].layout.num_experts
        if experts.size and (experts.min() < 0 or experts.max() >= n):
            bad = experts[(experts < 0) | (experts >= n)]
            raise ExpertIndexError(f"layer {layer}: expert index {int(bad[0])} out of range "
                                   f"(the layer has {n} experts)")

    def staging(self, layer: int, n: int) -> np.ndarray:
        """A reusable ``[n, blob_size]`` host buffer for ``layer`` (grown on demand)."""
        buf = self._staging.get(layer)
        if buf is None or buf.shape[0] < n:
            buf = np.empty((max(n, 1), self.layout(layer).blob_size), np.uint8)
            self._staging[layer] = buf
        return buf[:n]

    def read(self, layer: int, experts: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Blobs of ``experts`` (sorted, unique) of ``layer`` as ``[n, blob_size]`` uint8."""
        if self.closed:
            raise ModelClosedError("the expert store is closed; load the model again")
        self.check_experts(layer, experts)
        src = self.layers[layer]
        out = self.staging(layer, len(experts)) if out is None else out
        if self.io_mode == "mmap":
            src.read_mmap(experts, out)
        elif len(experts) <= 1 or self.threads <= 1:
            src.read_pread(experts, out)
        else:
            pool = self._executor()
            futures = [pool.submit(src.read_one, e, out[i]) for i, e in enumerate(experts)]
            errors = [f.exception() for f in futures]
            for err in errors:
                if err is not None:
                    raise err
        return out

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moeflux-read")
            return self._pool

    def close(self) -> None:
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for src in self.layers.values():
            src.close()
        self._staging.clear()


def open_store(path: Path, io_mode: Optional[str] = None, threads: int = 8) -> tuple:
    """Open the experts of a converted directory or a plain mlx-lm checkpoint.

    Returns ``(store, model_layout)``."""
    from .checkpoint import is_packed, packed_file, packed_layout, scan_checkpoint

    path = Path(path)
    if is_packed(path):
        model_layout = packed_layout(path)
        make = lambda i, lay: PackedLayer(i, lay, packed_file(path, i))  # noqa: E731
    else:
        ckpt = scan_checkpoint(path)
        model_layout = ckpt.layout
        make = lambda i, lay: SafetensorsLayer(i, lay, ckpt.ranges[i])  # noqa: E731
    layers = {}
    try:
        for i, lay in sorted(model_layout.layers.items()):
            layers[i] = make(i, lay)
    except Exception:
        for src in layers.values():
            src.close()
        raise
    mode = select_expert_io(model_layout.total_expert_bytes, io_mode)
    return ExpertStore(layers, mode, threads), model_layout
