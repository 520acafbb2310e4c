"""CUDA's runtime, through ctypes (no extra dependency): memory the GPU reads in place.

MLX arrays are writable through the buffer protocol. On Metal (unified memory) and the CPU
backend that view *is* the memory the kernels read, so experts are read from disk straight into
their pool slots ("host" slot writes, ``cache.pool``).

On CUDA, MLX allocates managed memory that lives on the GPU once a kernel touched it: a host
write then faults each page back to the host and the next kernel faults it over again: 1.5-2.5
GB/s on an H100. There experts are read into a staging array advised to stay in host memory and
mapped for the GPU (``cudaMemAdvise``), and a GPU scatter copies them into the slots ("device"
slot writes). The device-side table's control block and staging are page-locked shared memory
mapped for the GPU (``PinnedBuffer``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Optional

import mlx.core as mx

from ..cache.pool import host_view
from ..errors import DeviceSetupError
from .shared_memory import SharedMapping

log = logging.getLogger(__name__)


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
            lib.cudaMemAdvise.restype = ctypes.c_int
            lib.cudaGetDevice.restype = ctypes.c_int
            lib.cudaHostRegister.restype = ctypes.c_int
            lib.cudaHostUnregister.restype = ctypes.c_int
            lib.cudaHostGetDevicePointer.restype = ctypes.c_int
            major = name.split(".so.")[-1] if ".so." in name else ""
            return lib, major
        except (OSError, AttributeError):
            continue
    log.info("libcudart not found: expert uploads rely on page faults")
    return None


def cuda_runtime_available() -> bool:
    return _cudart() is not None


def _location(host: bool, dev: int) -> _MemLocation:
    return _MemLocation(2, 0) if host else _MemLocation(1, dev)  # cudaMemLocationType Host / Device


def host_staging(shape) -> Optional[mx.array]:
    """A uint8 MLX array whose pages stay in host memory, readable by the GPU in place.

    None where CUDA's runtime cannot be reached (the caller writes slots from the host then)."""
    rt = _cudart()
    if rt is None:
        return None
    lib, major = rt
    arr = mx.zeros(shape, mx.uint8, stream=mx.cpu)  # first touched by the host
    mx.eval(arr)
    view = host_view(arr)
    dev = ctypes.c_int(0)
    lib.cudaGetDevice(ctypes.byref(dev))
    ptr, n = ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(view.nbytes)
    set_preferred, set_accessed_by = 3, 5  # cudaMemoryAdvise
    if major == "12":
        errs = [
            lib.cudaMemAdvise(ptr, n, set_preferred, ctypes.c_int(-1)),  # cudaCpuDeviceId
            lib.cudaMemAdvise(ptr, n, set_accessed_by, dev),
        ]
    else:
        errs = [
            lib.cudaMemAdvise(ptr, n, set_preferred, _location(True, 0)),
            lib.cudaMemAdvise(ptr, n, set_accessed_by, _location(False, dev.value)),
        ]
    if any(errs):
        log.info("cudaMemAdvise returned %s: slot writes go through page faults", errs)
        return None
    return arr


PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
READ_ONLY = 0x08  # cudaHostRegisterReadOnly


class PinnedBuffer(SharedMapping):
    """Shared memory (``SharedMapping``: another process can map it too) that is
    page-locked and mapped for the GPU (``cudaHostRegister``), outside MLX's allocator: a numpy
    view for the host, a device address for kernels.

    Where CUDA's runtime cannot be reached it is plain shared memory (``device_ptr`` 0): enough
    for the host side and for tests that stand in for the kernels."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes)
        self.device_ptr = 0
        self._registered = False
        if _cudart() is None:
            return
        try:
            self.device_ptr = register_host(
                self.array.ctypes.data, len(self.map), PORTABLE_MAPPED, f"{nbytes} bytes"
            )
        except BaseException:
            super().close()
            raise
        self._registered = True

    def close(self) -> None:
        if self._registered:
            self._registered = False
            _cudart()[0].cudaHostUnregister(ctypes.c_void_p(self.array.ctypes.data))
        super().close()


def register_host(ptr: int, nbytes: int, flags: int, what: str, advice: str = "") -> int:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for the GPU (``cudaHostRegister`` with
    ``flags``, mapped among them); needs CUDA's runtime (``cuda_runtime_available``).

    Args:
        ptr, nbytes: the memory.
        flags: ``cudaHostRegister``'s flags (``PORTABLE_MAPPED``, ``READ_ONLY``).
        what: what the memory is, for the error.
        advice: appended to the error (what the user can do instead).

    Returns:
        The memory's device address.

    Raises:
        DeviceSetupError: CUDA refused; nothing stays registered.
    """
    lib = _cudart()[0]
    host = ctypes.c_void_p(ptr)
    err = lib.cudaHostRegister(host, ctypes.c_size_t(nbytes), flags)
    if err:
        raise DeviceSetupError(f"cudaHostRegister of {what} failed (error {err}){advice}")
    dev = ctypes.c_void_p()
    err = lib.cudaHostGetDevicePointer(ctypes.byref(dev), host, 0)
    if err:
        lib.cudaHostUnregister(host)
        raise DeviceSetupError(f"cudaHostGetDevicePointer of {what} failed (error {err})")
    if dev.value is None:  # success with a null address: nothing the GPU could use
        lib.cudaHostUnregister(host)
        raise DeviceSetupError(f"cudaHostGetDevicePointer of {what} returned no address")
    return int(dev.value)


def host_array(shape) -> mx.array:
    """``host_staging`` where CUDA's runtime can be reached, else a plain (CPU-written) array."""
    arr = host_staging(shape)
    if arr is None:  # no CUDA runtime to advise: a plain array still works, only slower
        arr = mx.zeros(shape, mx.uint8, stream=mx.cpu)
        mx.eval(arr)
    return arr


def device_slot_writes(requested: Optional[str] = None) -> bool:
    """Whether slot writes should go through host staging and a GPU scatter (CUDA), rather than
    straight into the pool's memory (Metal, CPU). ``requested``: ``host`` or ``device``
    (``LoadOptions.slot_writes``); None: by the device."""
    if requested in ("host", "device"):
        return requested == "device"
    return mx.default_device() == mx.gpu and cuda_runtime_available()


def table_available() -> bool:
    """Whether the device-side slot table can run: MLX's CUDA backend on the GPU, and libcudart."""
    return (
        hasattr(mx, "cuda")
        and mx.cuda.is_available()
        and mx.default_device() == mx.gpu
        and cuda_runtime_available()
    )
