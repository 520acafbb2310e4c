"""Cold reads for the benchmarks, beyond the product's (``moeflux_mlx.io.bandwidth``: expert
files, dropping them from the page cache, the disk's rate): which of a file's pages the page cache
holds, what the disk read, a process that holds RAM so that the page cache can keep only a share
of the experts, and the I/O bound's rate."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from moeflux_mlx.io.bandwidth import HelperProcess, read_bandwidth


def resident_pages(path: Path) -> Optional[np.ndarray]:
    """Which of ``path``'s pages the page cache holds: one 0/1 byte a page (``mincore`` on a
    read-only map of the file, which touches no page). None where ``mincore`` is unavailable or
    refuses."""
    size = os.path.getsize(path)
    if not size:
        return np.zeros(0, np.uint8)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, np.uint8)
        try:
            rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        except AttributeError:  # no mincore in this C library
            return None
        finally:
            del view  # the map cannot close while a view holds it
    return None if rc != 0 else np.frombuffer(vec, np.uint8) & 1


def cached_bytes(files: Sequence[Path]) -> Optional[int]:
    """How many bytes of ``files`` the page cache holds (whole pages; None: unknown here)."""
    total = 0
    for f in files:
        pages = resident_pages(f)
        if pages is None:
            return None
        total += int(pages.sum()) * mmap.PAGESIZE
    return total


def device_read_bytes(path: Path) -> Optional[int]:
    """Bytes the block device holding ``path`` has read since boot, every process's reads
    together (``/sys/dev/block/MAJOR:MINOR/stat``). None where there is no such file: not
    Linux, or a file system on no block device."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    try:
        return int(stat.read_text().split()[2]) * 512  # sectors of 512 bytes, whatever the disk's
    except (OSError, IndexError, ValueError):
        return None


# The balloon's loop (the first process the OOM killer takes). It keeps the kernel's
# MemAvailable near ``leave``: it takes anonymous memory (a byte written a page, so that it is
# really taken) while more is left and gives it back when other processes need it. Page-cache
# pages count as available, so the page cache may grow into what is left but no further. It
# prints "ready" once MemAvailable is within half a chunk of ``leave`` (or below it, holding
# nothing), and at the end the most it held.
_BALLOON = """
import mmap, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
leave, period, chunk = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
with open("/proc/self/oom_score_adj", "w") as f:
    f.write("1000")
def available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
held, size, most, steady = [], 0, 0, False
while not select.select([sys.stdin], [], [], period if steady else 0)[0]:
    gap = available() - leave
    if gap > chunk // 2:
        m = mmap.mmap(-1, min(chunk, gap), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)  # fewer faults: RAM fills at GB/s
        except (AttributeError, OSError):  # no transparent huge pages here
            pass
        memoryview(m)[:: mmap.PAGESIZE] = b"\1" * -(-len(m) // mmap.PAGESIZE)
        held.append(m)
        size += len(m)
        most = max(most, size)
    elif gap < -chunk // 2 and held:
        size -= len(held[-1])
        held.pop().close()
    elif not steady:
        steady = True
        print("ready", flush=True)
print("held", most, flush=True)
"""


def can_hold_ram() -> Optional[str]:
    """Why ``RamBalloon`` cannot do its job here (None: it can): it reads Linux's
    ``/proc/meminfo``, and swap would let the kernel move what it holds out of RAM."""
    try:
        with open("/proc/meminfo") as f:
            swap = next((line for line in f if line.startswith("SwapTotal:")), "")
    except OSError:
        return "holding RAM needs Linux's /proc/meminfo"
    if swap and int(swap.split()[1]):
        return "swap is on: the kernel would move the held memory out of RAM (swapoff -a first)"
    return None


class RamBalloon(HelperProcess):
    """Holds all of RAM but about ``leave_bytes`` in a process of its own, for as long as it
    runs, so that the page cache can keep no more than that (less, as it also holds every other
    file's cached pages): a model whose experts are a few times RAM, on a machine whose RAM
    holds them all. It gives memory back as other processes need it, and is the first process
    the OOM killer takes. Linux without swap (``can_hold_ram``); a memory limit on a container
    is not seen.

    ``held_bytes``: the most it held, known once it has stopped.

    Raises:
        RuntimeError: it cannot run here, exited, or was not ready within ``timeout_s``."""

    what = "RAM balloon"

    def __init__(
        self,
        leave_bytes: int,
        period_s: float = 0.05,
        chunk_bytes: int = 64 << 20,
        timeout_s: float = 150.0,
    ):
        why = can_hold_ram()
        if why:
            raise RuntimeError(why)
        super().__init__(
            _BALLOON, [str(int(leave_bytes)), str(period_s), str(chunk_bytes)], timeout_s
        )
        self.held_bytes = 0

    def finished(self, last: List[str]) -> None:
        self.held_bytes = int(last[-1])


def cold_bandwidth(path: Path, threads: int = 8) -> float:
    """The I/O bound's rate: the faster of the store's cold reads through the page cache and
    uncached (``read_bandwidth``, ``pread`` and ``direct``), bytes/s. Either way can be the
    faster on a given disk, and a decode through one must not beat the bound by the other."""
    return max(
        read_bandwidth(path, threads=threads, io_mode=m, warm=False)[0] for m in ("pread", "direct")
    )
