"""Getting expert bytes into memory the GPU reads, without extra copies.

MLX arrays are writable through the buffer protocol. On Metal (unified memory) and the CPU
backend that view *is* the memory the kernels read, so experts are read from disk straight into
their pool slots. On CUDA, MLX allocates managed memory: host writes land pages on the host and
the GPU would fault them over page by page; ``prefetch_to_device`` asks the driver to migrate the
written range in bulk (``cudaMemPrefetchAsync``, through ctypes: no extra dependency).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)


def host_view(arr: mx.array) -> np.ndarray:
    """A writable uint8 numpy view of an evaluated, row-contiguous MLX array's memory."""
    return np.frombuffer(memoryview(arr), np.uint8).reshape(arr.shape[0], -1)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


@functools.lru_cache(maxsize=1)
def _cudart():
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return None
    for name in ("libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            lib.cudaMemPrefetchAsync.restype = ctypes.c_int
            lib.cudaGetDevice.restype = ctypes.c_int
            major = name.split(".so.")[-1] if ".so." in name else ""
            return lib, major
        except (OSError, AttributeError):
            continue
    log.info("libcudart not found: expert uploads rely on page faults")
    return None


def cuda_prefetch_available() -> bool:
    return _cudart() is not None


def prefetch_to_device(view: np.ndarray) -> bool:
    """Ask CUDA to migrate the managed pages under ``view`` to the GPU now. A hint only."""
    rt = _cudart()
    if rt is None or view.size == 0:
        return False
    lib, major = rt
    dev = ctypes.c_int(0)
    lib.cudaGetDevice(ctypes.byref(dev))
    ptr, n = ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(view.nbytes)
    if major == "12":
        err = lib.cudaMemPrefetchAsync(ptr, n, dev, ctypes.c_void_p(0))
    else:  # CUDA 13: (ptr, count, cudaMemLocation{Device, id}, flags, stream)
        err = lib.cudaMemPrefetchAsync(ptr, n, _MemLocation(1, dev.value), ctypes.c_uint(0),
                                       ctypes.c_void_p(0))
    if err:
        log.debug("cudaMemPrefetchAsync returned %d", err)
    return err == 0


def upload(arr: mx.array) -> mx.array:
    """Hint that ``arr`` (just written through a host view) is about to be read by the GPU."""
    if cuda_prefetch_available():
        prefetch_to_device(host_view(arr))
    return arr
