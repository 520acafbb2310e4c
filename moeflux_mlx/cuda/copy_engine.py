"""The GPU's copy engines for host-to-device copies beside MLX (``cache.row_copies``).

``cudaMemcpy2DAsync`` on a stream of this module's own, from page-locked memory
(``PinnedBuffer``) into MLX arrays: MLX's CUDA backend allocates managed memory whose address is
valid on the device, and an array evaluated by a kernel lives there. The copies never enter
MLX's queues; their caller waits for them (``wait``) before any computation reads the arrays.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

from ..errors import DeviceSetupError
from .runtime import PinnedBuffer, _cudart

log = logging.getLogger(__name__)

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the addresses
_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit order with the legacy default stream


class CopyEngine:
    """``RowCopies`` on the GPU's copy engines. Raises ``DeviceSetupError`` if a call fails."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        for fn in (
            "cudaMemcpy2DAsync",
            "cudaStreamSynchronize",
            "cudaStreamCreateWithFlags",
            "cudaStreamDestroy",
            "cudaSetDevice",
        ):
            getattr(lib, fn).restype = ctypes.c_int
        dev = ctypes.c_int(0)
        lib.cudaGetDevice(ctypes.byref(dev))
        self._device = dev.value  # the copies run on another thread: it must name the device
        self._stream = ctypes.c_void_p()
        self._check(
            lib.cudaStreamCreateWithFlags(ctypes.byref(self._stream), _NON_BLOCKING),
            "cudaStreamCreateWithFlags",
        )

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise DeviceSetupError(f"{what} failed (CUDA error {err})")

    def buffer(self, nbytes: int) -> PinnedBuffer:
        return PinnedBuffer(nbytes)

    def copy_rows(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int
    ) -> None:
        lib = self._lib
        self._check(lib.cudaSetDevice(self._device), "cudaSetDevice")
        size = ctypes.c_size_t
        err = lib.cudaMemcpy2DAsync(
            ctypes.c_void_p(dst),
            size(dst_pitch),
            ctypes.c_void_p(src),
            size(src_pitch),
            size(width),
            size(rows),
            _MEMCPY_DEFAULT,
            self._stream,
        )
        self._check(err, f"cudaMemcpy2DAsync of {rows} x {width} bytes")

    def wait(self) -> None:
        self._check(self._lib.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def close(self) -> None:
        if self._stream is not None and self._stream.value:
            self._lib.cudaStreamSynchronize(self._stream)
            self._lib.cudaStreamDestroy(self._stream)
        self._stream = None  # type: ignore[assignment]


def copy_engine() -> Optional[CopyEngine]:
    """The GPU's copy engines, or None where CUDA's runtime cannot be reached or will not give
    them a stream (the caller copies with a kernel then)."""
    rt = _cudart()
    if rt is None:
        return None
    try:
        return CopyEngine(rt[0])
    except DeviceSetupError as err:
        log.warning("copy engines unavailable (%s): a prefill copies with a kernel", err)
        return None
