"""Copies of host rows into MLX memory outside MLX's queues: a prefill's whole-layer uploads.

A prefill at a small budget moves every expert of a layer to the device. Copied by a kernel
reading mapped host staging, those bytes take the GPU's cores beside the computation; the GPU's
copy engines (``cuda.copy_engine.CopyEngine``) move them on their own, from page-locked memory,
on the read thread, so the computation never waits behind them. ``HostRowCopies`` does the same
where MLX's memory is the host's (the CPU backend): the path runs, and is tested, everywhere.

Who writes what, and when: a copy writes only arrays that were allocated and evaluated for it
and that no computation reads before ``wait()`` has returned (``cache.whole_layer``).
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import numpy as np

from ..io.uncached import aligned_empty


class HostBuffer(Protocol):
    """Host memory the copies read: ``array`` (uint8), page-aligned; ``close()`` lets it go."""

    array: np.ndarray

    def close(self) -> None: ...


class RowCopies(Protocol):
    def buffer(self, nbytes: int) -> HostBuffer:
        """``nbytes`` of host memory the copies read fastest from (page-locked on CUDA)."""
        ...

    def copy_rows(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int
    ) -> None:
        """Queue ``rows`` rows of ``width`` bytes from ``src`` (a ``buffer``) to ``dst`` (an
        evaluated MLX array's memory), rows ``src_pitch`` and ``dst_pitch`` bytes apart."""
        ...

    def wait(self) -> None:
        """Return once every queued copy has landed."""
        ...

    def close(self) -> None: ...


class _PlainBuffer:
    def __init__(self, nbytes: int):
        self.array = aligned_empty(nbytes)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]


class HostRowCopies:
    """``RowCopies`` for MLX memory the host addresses (the CPU backend): copies at once."""

    def buffer(self, nbytes: int) -> HostBuffer:
        return _PlainBuffer(nbytes)

    def copy_rows(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int
    ) -> None:
        def rows_at(ptr: int, pitch: int) -> np.ndarray:
            span = (ctypes.c_uint8 * ((rows - 1) * pitch + width)).from_address(ptr)
            flat = np.ctypeslib.as_array(span)
            return np.lib.stride_tricks.as_strided(flat, (rows, width), (pitch, 1))

        if rows > 0 and width > 0:
            rows_at(dst, dst_pitch)[:] = rows_at(src, src_pitch)

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass
