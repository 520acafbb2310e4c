"""Reads that bypass the page cache, for ``expert_io=direct``.

Where the experts are many times RAM, a cold expert's bytes are seldom asked again before the page
cache evicts them, and passing them through it costs a copy and the cache's bookkeeping per page:
on an H200 VM's disk, miss batches of 2-6 experts read uncached came within 88-96% of the disk's
stream rate against 77-89% through the cache. The price is that an expert
read again soon comes from the disk again, which is why the RAM gate never chooses this mode.

On Linux a second descriptor of each expert file is opened with ``O_DIRECT``, which reads straight
into the caller's buffer but needs the file offset, length and buffer address to be multiples of
the device's logical block (``ALIGN`` covers 512- and 4096-byte blocks). A range whose buffer
lies at the same offset within a page as its file offset (a converted model whose experts are
whole pages, read into page-aligned staging) is read in place, its partial first and last pages
through the ordinary descriptor; any other range (a plain checkpoint's tensors, experts of a size
that is not whole pages) goes through a page-aligned bounce buffer of the reading thread and is
copied into place. On macOS the second descriptor has caching off (``F_NOCACHE``), which needs no
alignment. Where neither works (a file system without ``O_DIRECT``), ``UncachedFile.open``
returns None with the reason, and the store reads that file through the page cache.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from ..errors import ExpertReadError
from ..format import readers

ALIGN = 4096
# a bounced range is read in steps of at most this size (a store's pieces are 512 KiB)
BOUNCE_BYTES = 1 << 20
_local = threading.local()


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` that starts on an ``ALIGN`` boundary."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes]


def _bounce() -> np.ndarray:
    buf = getattr(_local, "bounce", None)
    if buf is None:  # one per reading thread, kept for its life
        buf = _local.bounce = aligned_empty(BOUNCE_BYTES + 2 * ALIGN)
    return buf


def _read_direct(fd: int, into: np.ndarray, offset: int, need: int, what: str) -> None:
    """``O_DIRECT`` reads from ``offset`` (aligned) into ``into`` (aligned, a multiple of
    ``ALIGN`` long) until at least ``need`` bytes have come; fewer before the end of the file is
    a short read. ``OSError`` is raised as it comes (the caller decides what it means)."""
    done = 0
    while done < need:
        got = os.preadv(fd, [memoryview(into[done:])], offset + done)
        if got == 0 or (got % ALIGN and done + got < need):  # the file ends before ``need``
            raise ExpertReadError(
                f"{what}: short read, {done + got} of {need} bytes at offset {offset} "
                "(file truncated?)"
            )
        done += got


class UncachedFile:
    """A second descriptor of one expert file whose reads bypass the page cache
    (``open_uncached`` makes one)."""

    def __init__(self, path: Path, fd: int, buffered_fd: int, aligned: bool):
        self.path, self.fd, self.buffered_fd = Path(path), fd, buffered_fd
        self.aligned = aligned  # O_DIRECT: offsets, lengths and buffers in whole ALIGN blocks

    def read(self, start: int, into: np.ndarray, what: str) -> None:
        """Fill ``into`` (1-d, contiguous uint8) with the bytes at ``start``, uncached.

        Raises:
            ExpertReadError: the read failed or the file ends first, naming ``what``.
        """
        if not self.aligned:
            readers.read_exact(self.fd, start, memoryview(into), what)
            return
        end = start + len(into)
        lo, hi = -(-start // ALIGN) * ALIGN, end // ALIGN * ALIGN
        if (into.ctypes.data - start) % ALIGN == 0 and hi - lo >= ALIGN:
            try:
                _read_direct(self.fd, into[lo - start : hi - start], lo, hi - lo, what)
            except ExpertReadError:  # an OSError too: already says what went wrong
                raise
            except OSError as e:
                if e.errno not in (errno.EFAULT, errno.EINVAL):
                    raise ExpertReadError(
                        f"{what}: read of {hi - lo} bytes at offset {lo} failed: {e}"
                    ) from e
                # memory the kernel cannot read into directly (e.g. CUDA managed memory)
                self._bounced(start, into, what)
                return
            for a, b in ((start, lo), (hi, end)):  # partial pages: a few KiB, through the cache
                if b > a:
                    readers.read_exact(
                        self.buffered_fd, a, memoryview(into[a - start : b - start]), what
                    )
            return
        self._bounced(start, into, what)

    def _bounced(self, start: int, into: np.ndarray, what: str) -> None:
        bounce, end, at = _bounce(), start + len(into), start
        while at < end:
            lo = at // ALIGN * ALIGN
            stop = min(end, lo + BOUNCE_BYTES)
            span = -(-(stop - lo) // ALIGN) * ALIGN
            try:
                _read_direct(self.fd, bounce[:span], lo, stop - lo, what)
            except ExpertReadError:  # an OSError too: already says what went wrong
                raise
            except OSError as e:
                raise ExpertReadError(
                    f"{what}: read of {len(into)} bytes at offset {start} failed: {e}"
                ) from e
            into[at - start : stop - start] = bounce[at - lo : stop - lo]
            at = stop

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _or_close(fd: int, step) -> str:
    """Run ``step()``; on ``OSError`` close ``fd`` and return why (on any other exception close
    it and raise); "" when it went well."""
    try:
        step()
    except OSError as e:
        os.close(fd)
        return e.strerror or str(e)
    except BaseException:
        os.close(fd)
        raise
    return ""


def open_uncached(path: Path, buffered_fd: int) -> Tuple[Optional[UncachedFile], str]:
    """A descriptor of ``path`` whose reads bypass the page cache.

    Args:
        path: an expert file.
        buffered_fd: the store's ordinary descriptor of it, for partial pages.

    Returns:
        ``(UncachedFile, "")``, or ``(None, why)`` where ``path`` must be read through the
        page cache.
    """
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            return None, f"cannot open with O_DIRECT: {e.strerror}"
        # some file systems accept the flag and refuse the reads (a short file too)
        why = _or_close(fd, lambda: os.preadv(fd, [memoryview(_bounce()[:ALIGN])], 0))
        if why:
            return None, f"O_DIRECT reads fail: {why}"
        return UncachedFile(path, fd, buffered_fd, aligned=True), ""
    if sys.platform == "darwin":
        import fcntl

        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            return None, f"cannot open: {e.strerror}"
        why = _or_close(fd, lambda: fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1))
        if why:
            return None, f"cannot turn caching off (F_NOCACHE): {why}"
        return UncachedFile(path, fd, buffered_fd, aligned=False), ""
    return None, f"no uncached reads on {sys.platform}"
