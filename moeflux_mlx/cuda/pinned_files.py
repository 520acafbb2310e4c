"""Expert files page-locked for the GPU: misses copied out of the page cache in place (CUDA).

With ``LoadOptions.pin_experts`` the table layers' expert files are mapped read-only and
registered with CUDA (``cudaHostRegister``, mapped + read-only), which faults every page in and
keeps it in RAM. The fill kernel then copies a missed expert from its file straight into its
slot over the bus (fill_cuda.cuh with the ``sources`` of ``table_kernels``), and the miss server
only picks slots: no read into staging, no read threads, no round trip of the bytes through the
server process. The copy list's sources are then expert ids instead of staging rows.

Who writes what: nobody writes the mapped files' bytes; this process maps, registers, and
unregisters them (``close``, after the last table call has finished).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import psutil

from ..cache.pool import InPlaceExperts
from ..errors import DeviceSetupError
from ..format.layout import ExpertLayout
from ..io.store import RAM_FRACTION, ExpertStore
from .runtime import PORTABLE_MAPPED, READ_ONLY, _cudart, register_host

log = logging.getLogger(__name__)


@dataclass
class LayerSources:
    """Where the GPU finds each expert component of one layer: a device address of expert 0's
    bytes (0 without CUDA) and the stride between experts, per component (in the layout's
    order); ``rows``: the
    same bytes as host arrays ``[num_experts, nbytes]`` (what the CPU stand-in of the kernels
    copies)."""

    device_ptrs: List[int]
    strides: List[int]
    rows: List[np.ndarray]

    def aligned(self, k: int, nbytes: int) -> bool:
        """Whether component ``k`` (``nbytes`` an expert) can be copied in 16-byte words: its
        address, its stride and its size all multiples of 16."""
        return self.device_ptrs[k] % 16 == 0 and self.strides[k] % 16 == 0 and nbytes % 16 == 0

    def in_place(self, layout: ExpertLayout) -> Optional[InPlaceExperts]:
        """Where the expert kernels read the experts a pass leaves outside the slots, or None
        where a component's address or stride is not a multiple of 4 (their word loads)."""
        if any(p % 4 or s % 4 for p, s in zip(self.device_ptrs, self.strides)):
            return None
        names = [c.name for c in layout.components]
        return InPlaceExperts(
            dict(zip(names, zip(self.device_ptrs, self.strides))), dict(zip(names, self.rows))
        )


class _PinnedFile:
    """One file mapped read-only and, where CUDA's runtime is, registered for the GPU."""

    def __init__(self, path: Path):
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # a read-only buffer too
        except (OSError, ValueError) as e:
            raise DeviceSetupError(f"{path}: cannot map the expert file to pin it: {e}") from e
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.map, np.uint8)
        self.device_ptr = 0  # none without CUDA: the CPU stand-in reads ``array``
        self._registered = False
        if _cudart() is None:
            return
        try:
            self.device_ptr = register_host(
                self.array.ctypes.data,
                self.array.size,
                PORTABLE_MAPPED | READ_ONLY,
                f"the mapped expert file {path}",
                "; load without pin_experts (MOEFLUX_PIN_EXPERTS=0)",
            )
        except BaseException:
            self.close()
            raise
        self._registered = True

    def close(self) -> None:
        if self._registered:
            self._registered = False
            lib = _cudart()[0]
            # every stream of the device, not only those its caller knows: no kernel may still
            # be copying out of the file when its pages are unlocked and unmapped
            lib.cudaDeviceSynchronize()
            err = lib.cudaHostUnregister(ctypes.c_void_p(self.array.ctypes.data))
            if err:  # still registered: unmapping would leave CUDA a stale range, so keep it
                log.warning("%s: cudaHostUnregister failed (error %d); kept mapped", self.path, err)
                return
        self.array = np.empty(0, np.uint8)
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps it later
            pass


# ``pin_experts`` auto pins where the expert files take at most this share of physical RAM (and
# fit in the memory available): what stays is the model's, the KV cache's and the system's
PIN_RAM_SHARE = 0.5


def _runs(store: ExpertStore, layers: Iterable[int]):
    """Each layer's component runs (layers without one run per expert left out), the files they
    lie in, and the files' total bytes."""
    found = {i: store.component_runs(i) for i in layers}
    runs = {i: r for i, r in found.items() if r is not None}
    paths = sorted({p for r in runs.values() for p, _, _ in r})
    return runs, paths, sum(os.path.getsize(p) for p in paths)


def pin_by_default(store: ExpertStore, layers: Iterable[int]) -> Tuple[bool, str]:
    """Whether ``pin_experts`` left to the machine pins the expert files of ``layers``, and why:
    they take at most ``PIN_RAM_SHARE`` of physical RAM and fit in the memory available.

    Args:
        store: the expert store.
        layers: the layers the device-side table serves.

    Returns:
        ``(pin, why)``.
    """
    _, paths, total = _runs(store, layers)
    mem = psutil.virtual_memory()
    size, ram = (
        f"expert files {total / 1e9:.2f} GB",
        f"{PIN_RAM_SHARE:g} x RAM {mem.total / 1e9:.2f} GB",
    )
    if not paths:
        return False, "no expert file holds each expert's components in one run"
    if total > PIN_RAM_SHARE * mem.total:
        return False, f"{size} > {ram}"
    if total >= mem.available:
        return False, f"{size} > the memory available, {mem.available / 1e9:.2f} GB"
    return True, f"{size} <= {ram}"


class PinnedExperts:
    """The expert files of ``layers``, page-locked for the GPU; ``sources[layer]`` says where
    each layer's experts lie. Layers whose components are not one run per expert (a
    tensor-parallel part) are left out: the miss server reads those as before.

    Raises:
        DeviceSetupError: the files exceed 0.75 x RAM, or one cannot be mapped or registered
            (the message names it); nothing stays mapped or registered then.
    """

    def __init__(self, store: ExpertStore, layers: Iterable[int]):
        runs, paths, total = _runs(store, layers)
        ram = psutil.virtual_memory().total
        if total > RAM_FRACTION * ram:
            raise DeviceSetupError(
                f"pin_experts: the expert files ({total / 1e9:.2f} GB) exceed {RAM_FRACTION} x "
                f"RAM ({ram / 1e9:.2f} GB) and cannot all stay in memory; load without it "
                "(MOEFLUX_PIN_EXPERTS=0)"
            )
        self.files: Dict[Path, _PinnedFile] = {}
        self.sources: Dict[int, LayerSources] = {}
        try:
            for p in paths:
                self.files[p] = _PinnedFile(p)
            for i, layer_runs in runs.items():
                layout = store.layout(i)
                self.sources[i] = LayerSources(
                    [_device_address(self.files[p], off) for p, off, _ in layer_runs],
                    [stride for _, _, stride in layer_runs],
                    [
                        _rows(self.files[p].array, off, stride, c.nbytes, layout.num_experts)
                        for (p, off, stride), c in zip(layer_runs, layout.components)
                    ],
                )
            self._check(store, runs)
        except BaseException:  # nothing stays registered
            self.close()
            raise
        log.info(
            "pinned %d expert files (%.2f GB) for the GPU: %d layers' misses copied in place",
            len(paths),
            total / 1e9,
            len(self.sources),
        )

    def _check(self, store: ExpertStore, runs: Dict[int, List[Tuple[Path, int, int]]]) -> None:
        """Each layer whose experts lie whole and in order in one file (a converted layer, the
        ones with recorded checksums) checked against its CRC-32s once, here, on every core:
        nothing the GPU copies out of the files goes through the store's reads.

        Raises:
            ExpertChecksumError: an expert's bytes are not those convert wrote.
        """
        jobs = []
        for i, layer_runs in runs.items():
            layout = store.layout(i)
            path, offset, stride = layer_runs[0]
            base = offset - layout.components[0].offset
            if stride != layout.blob_size or base < 0:
                continue
            blobs = self.files[path].array[base : base + layout.num_experts * stride]
            jobs.append((i, blobs.reshape(layout.num_experts, stride)))
        if jobs:  # zlib lets go of the GIL: one thread a core
            with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
                list(pool.map(lambda job: store.check_layer(*job), jobs))

    def close(self) -> None:
        for src in self.sources.values():  # drop the views, so the files unmap at once
            src.rows.clear()
        self.sources = {}
        for f in self.files.values():
            f.close()
        self.files = {}


def _device_address(f: _PinnedFile, offset: int) -> int:
    """The GPU's address of byte ``offset`` of ``f``; 0 where it has none (no CUDA)."""
    return f.device_ptr + offset if f.device_ptr else 0


def _rows(array: np.ndarray, offset: int, stride: int, nbytes: int, count: int) -> np.ndarray:
    """``[count, nbytes]`` read-only rows of ``array``, ``stride`` apart from ``offset``."""
    need = offset + (count - 1) * stride + nbytes
    if array.size < need:
        raise DeviceSetupError(f"an expert file holds {array.size} bytes, {need} needed")
    return np.lib.stride_tricks.as_strided(
        array[offset:], (count, nbytes), (stride, 1), writeable=False
    )
