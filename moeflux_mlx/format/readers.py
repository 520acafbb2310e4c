"""One MoE layer's expert bytes on disk, and reading them exactly.

Two sources describe where one layer's experts lie: ``PackedLayer`` (a converted
``layer_NN.bin``, one contiguous read per expert) and ``SafetensorsLayer`` (a plain mlx-lm
checkpoint: each expert is a slice of every stacked tensor, one read per component). Both produce
the same blob bytes, by ``pread`` (``read_pread``, ``read_one``, ``pieces``) or out of an ``mmap``
of the same files (``read_mmap``). Plain numpy: no MLX.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import ExpertFileError, ExpertReadError
from .layout import ExpertLayout
from .safetensors import TensorRange, open_readonly

log = logging.getLogger(__name__)

# expert ids, as a list or an integer array
Experts = Union[Sequence[int], np.ndarray]


def advise_random_reads(fd: int, what: str) -> None:
    """Turn the kernel's readahead off for ``fd``. The pieces of one expert, read in parallel,
    look like a sequential stream to it, and it reads on past the expert: on a disk with 8 MiB
    readahead, it read 3x the bytes and took 2-3x the time per batch of misses through the store.
    Only a hint: failure is ignored."""
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
            raise ExpertReadError(
                f"{what}: short read, {done} of {n} bytes at offset {start} (file truncated?)"
            )
        done += got


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
        self.array = np.empty(0, np.uint8)  # drop the view of the map before closing it
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
        raise ExpertReadError(
            f"{what}: the file shrank to {size} bytes since it was opened "
            f"({need} needed); truncated or rewritten while in use?"
        )


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
                f"({'truncated' if size < layout.layer_bytes else 'wrong file or layout'}?)"
            )
        self._map: Optional[_Mapping] = None

    def _what(self, e: int) -> str:
        return f"{self.path} (layer {self.layer}, expert {int(e)})"

    def read_pread(self, experts: Experts, out: np.ndarray) -> None:
        for i, e in enumerate(experts):
            self.read_one(e, out[i])

    def read_one(self, e: int, out: np.ndarray) -> None:
        read_exact(self.fd, int(e) * self.layout.blob_size, memoryview(out), self._what(e))

    def file_descriptors(self) -> Dict[Path, int]:
        return {self.path: self.fd}

    def pieces(self, e: int):
        """(fd, file offset, blob offset, bytes, what) of expert ``e``'s bytes."""
        return [(self.fd, int(e) * self.layout.blob_size, 0, self.layout.blob_size, self._what(e))]

    def component_runs(self) -> List[Tuple[Path, int, int]]:
        """Per layout component: (file, offset of expert 0's bytes, stride from one expert's to
        the next's): where anyone mapping the file finds each expert's component."""
        return [(self.path, c.offset, self.layout.blob_size) for c in self.layout.components]

    def read_mmap(self, experts: Experts, out: np.ndarray) -> None:
        what = f"{self.path} (layer {self.layer})"
        _check_mapped(self.fd, self.layout.layer_bytes, what)
        if self._map is None:
            self._map = _Mapping(self.fd, what)
        if self._map.size < self.layout.layer_bytes:  # mapped while shorter: never read past it
            raise ExpertReadError(
                f"{what}: mapped {self._map.size} bytes, {self.layout.layer_bytes} needed"
            )
        view = self._map.array.reshape(self.layout.num_experts, -1)
        try:
            np.take(view, experts, axis=0, out=out)
        except (OSError, ValueError, IndexError) as e:
            raise ExpertReadError(
                f"{what}: mapped read of experts {list(experts)} failed: {e}"
            ) from e

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
                            f"{self._need[r.file]} (truncated?)"
                        )
        except BaseException:
            self.close()
            raise

    def read_one(self, e: int, out: np.ndarray) -> None:
        for fd, start, at, n, what in self.pieces(e):
            read_exact(fd, start, memoryview(out[at : at + n]), what)

    def file_descriptors(self) -> Dict[Path, int]:
        return dict(self.fds)

    def component_runs(self) -> List[Tuple[Path, int, int]]:
        """As ``PackedLayer.component_runs``: each component's stacked tensor."""
        return [(r.file, r.start, c.nbytes) for c, r in self.parts]

    def pieces(self, e: int):
        return [
            (
                self.fds[r.file],
                r.start + int(e) * c.nbytes,
                c.offset,
                c.nbytes,
                f"{r.file} (layer {self.layer}, expert {int(e)}, {c.name})",
            )
            for c, r in self.parts
        ]

    def read_pread(self, experts: Experts, out: np.ndarray) -> None:
        for i, e in enumerate(experts):
            self.read_one(e, out[i])

    def read_mmap(self, experts: Experts, out: np.ndarray) -> None:
        for f, fd in self.fds.items():
            _check_mapped(fd, self._need[f], f"{f} (layer {self.layer})")
        idx = np.asarray(experts)
        for c, r in self.parts:
            m = self._maps.get(r.file)
            if m is None:
                m = self._maps[r.file] = _Mapping(
                    self.fds[r.file], f"{r.file} (layer {self.layer})"
                )
            if m.size < r.start + r.nbytes:
                raise ExpertReadError(
                    f"{r.file} (layer {self.layer}): mapped {m.size} bytes, "
                    f"{r.start + r.nbytes} needed"
                )
            stacked = m.array[r.start : r.start + r.nbytes].reshape(-1, c.nbytes)
            out[:, c.offset : c.offset + c.nbytes] = stacked[idx]

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


LayerSource = Union[PackedLayer, SafetensorsLayer]  # where one layer's expert bytes lie
