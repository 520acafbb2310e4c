"""Memory that another process can map too: the device-side table's control block and
staging, shared between the model's process and the miss server. Plain Python, no MLX."""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Optional

import numpy as np


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class SharedMapping:
    """``nbytes`` of zeroed memory that another process can map too: a memfd where Linux has one,
    else a file in the temporary directory, unlinked at once. ``fd`` is what to pass on."""

    def __init__(self, nbytes: int, fd: Optional[int] = None):
        self.nbytes = max(int(nbytes), 1)
        self.owner = fd is None
        if fd is None:
            if hasattr(os, "memfd_create"):
                fd = os.memfd_create("moeflux-shared", 0)
            else:
                fd, name = tempfile.mkstemp(prefix="moeflux-shared-")
                os.unlink(name)
            os.ftruncate(fd, round_up(self.nbytes, mmap.PAGESIZE))
        self.fd = fd
        self.map = mmap.mmap(
            fd,
            round_up(self.nbytes, mmap.PAGESIZE),
            mmap.MAP_SHARED,
            mmap.PROT_READ | mmap.PROT_WRITE,
        )
        self.array = np.frombuffer(self.map, np.uint8)[: self.nbytes]

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)  # drops the view of the map, so that it can close
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps it later
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
