"""Cold reads for the benchmarks: which files hold a model's experts, which of their pages the
page cache holds, dropping them from it (once, or continuously from a process of its own), a
process that holds RAM so that the page cache can keep only a share of them, and the disk's rate
for the store's cold reads of whole experts."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..format.checkpoint import (
    is_packed,
    packed_file,
    packed_layout,
    scan_checkpoint,
)
from ..io.store import open_store


def expert_files(path: Path) -> List[Path]:
    if is_packed(path):
        return [packed_file(path, i) for i in packed_layout(path).layers]
    ckpt = scan_checkpoint(path)
    return sorted({r.file for comps in ckpt.ranges.values() for r in comps.values()})


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


def drop_page_cache(files: Sequence[Path]) -> None:
    """Evict the files' pages from the OS page cache (clean pages; no root needed on Linux).
    Dirty pages cannot be dropped: a file just written (a model converted a moment ago) is
    flushed first."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Helper:
    """A loop in a process of its own beside the decode (``script``, run with ``args``): it
    ignores Ctrl-C (the benchmark stops it), prints "ready" once it is doing its job, and runs
    until its stdin closes, then prints its last line. ``__enter__`` waits for "ready"; a
    failure of the helper is raised only when nothing else is already on its way up."""

    what = "helper"

    def __init__(self, script: str, args: Sequence[str], timeout_s: float):
        self.script, self.args, self.timeout_s = script, list(args), timeout_s
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self):
        self._proc = proc = subprocess.Popen(
            [sys.executable, "-c", self.script, *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        try:
            ready = select.select([proc.stdout], [], [], self.timeout_s)[0]
            line = proc.stdout.readline().strip() if ready else ""
        except BaseException:
            self._stop()
            raise
        if line != "ready":
            self._stop()
            why = (
                f"exited with code {proc.returncode}"
                if proc.returncode is not None
                else f"was not ready within {self.timeout_s:.0f} s"
            )
            raise RuntimeError(f"the {self.what} {why}")
        return self

    def _stop(self) -> str:
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        try:
            out, _ = proc.communicate(timeout=30)  # closes its stdin: the signal to stop
        except BaseException:
            proc.kill()  # never left behind
            proc.wait()
            raise
        return out if proc.returncode == 0 else ""

    def __exit__(self, exc_type, *exc):
        last = self._stop().split()
        if exc_type is None:
            if not last:
                raise RuntimeError(f"the {self.what} died before it was told to stop")
            self.finished(last)

    def finished(self, last: List[str]) -> None:
        """Reads the helper's last line."""


# The dropper's loop: a thread of the benchmark's process needs the GIL every period, so how
# often it ran depended on what the decoding thread was doing (a decode that held the GIL kept
# its reads warm), and each wake-up took the GIL from the decode being timed. It sleeps in
# select() on stdin, which the benchmark closes to stop it.
_DROPPER = """
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
period = float(sys.argv[1])
fds = [os.open(f, os.O_RDONLY) for f in sys.argv[2:]]
drops = 0
while True:
    for fd in fds:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    drops += 1
    if drops == 1:
        print("ready", flush=True)
    if select.select([sys.stdin], [], [], period)[0]:
        break
print(drops, flush=True)
"""


class PageCacheDropper(_Helper):
    """Drops the files' pages from the page cache every ``period_s``, in a process of its own,
    for as long as it runs: reads that follow are cold, as if the experts were many times RAM.

    Nothing is excluded from the timed region: the drops run beside the decode, on a core of
    their own, sharing nothing with it but the kernel's page cache. Mapped pages cannot be
    dropped this way (mmap runs are cold only at their start). ``drops``: how many rounds of
    drops it made, known once it has stopped.

    Raises:
        RuntimeError: the dropper failed."""

    what = "page-cache dropper"

    def __init__(self, files: Sequence[Path], period_s: float = 1e-3):
        super().__init__(_DROPPER, [str(period_s), *map(str, files)], timeout_s=60)
        self.drops = 0

    def finished(self, last: List[str]) -> None:
        self.drops = int(last[-1])


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


class RamBalloon(_Helper):
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


# the most experts of one layer that one store call reads when measuring the disk's rate: a miss
# batch many experts deep (a decode's batch is a few), within the store's kept staging
BANDWIDTH_BATCH = 32


def read_bandwidth(
    path: Path,
    reads: int = 256,
    threads: int = 8,
    seed: int = 0,
    before_pass: Optional[Callable[[List[int], bool], None]] = None,
    io_mode: str = "pread",
    warm: bool = True,
) -> Tuple[float, float]:
    """The disk's rate for the store's own reads, as one stream: ``reads`` distinct experts (all
    of them when the model has fewer), drawn at random over the MoE layers, read by the store
    (``io_mode``, ``threads`` read threads, readahead off) one call per layer for up to
    ``BANDWIDTH_BATCH`` of them: the reads of a miss batch, but many experts deep, so that the
    disk always has work queued. No expert is read twice in a pass: reads at random offsets
    overlap, and the bytes the page cache then serves would count as the disk's
    (docs/benchmarks.md, "Cold 25% budget vs the I/O bound").

    Args:
        path: a converted or plain checkpoint, as ``io.store.open_store`` opens it.
        reads: how many experts.
        threads: the store's read threads.
        seed: which experts.
        before_pass: called with the descriptors before each timed pass (``cold`` True, then
            False); None: the page cache is dropped before the cold pass (``drop_page_cache``).
        io_mode: ``pread``, or ``direct`` (uncached: every pass is cold).
        warm: also time the warm passes; False: the cold pass only (warm is then 0.0).

    Returns:
        ``(cold, warm)`` bytes/s: after dropping the page cache (or with ``before_pass``'s
        caching off), and the same reads again after an untimed pass has cached them.

    Raises:
        CheckpointError: ``open_store`` cannot open the checkpoint's experts.
    """
    store, layout = open_store(path, io_mode, threads=threads)
    with store:
        experts = [(i, e) for i, lay in layout.layers.items() for e in range(lay.num_experts)]
        picked = random.Random(seed).sample(experts, min(reads, len(experts)))
        calls = []
        for i in sorted({i for i, _ in picked}):
            mine = sorted(e for j, e in picked if j == i)
            for at in range(0, len(mine), BANDWIDTH_BATCH):
                calls.append((i, np.array(mine[at : at + BANDWIDTH_BATCH])))
        random.Random(seed).shuffle(calls)
        total = sum(len(ex) * layout.layers[i].blob_size for i, ex in calls)
        fds = sorted({fd for i, _ in calls for fd in store.layers[i].file_descriptors().values()})

        if calls:  # the staging buffer is allocated before the timing starts
            store.staging(calls[0][0], max(len(ex) for _, ex in calls))

        def one_pass() -> None:
            for i, ex in calls:
                store.read(i, ex)

        rates = [0.0, 0.0]
        for k, cold in enumerate((True, False)[: 2 if warm else 1]):
            if before_pass is not None:
                before_pass(fds, cold)
            elif cold:
                drop_page_cache(expert_files(path))
            if not cold:  # what a pass with caching off read is not cached yet
                one_pass()
            t = time.perf_counter()
            one_pass()
            rates[k] = total / (time.perf_counter() - t)
    return rates[0], rates[1]


def cold_bandwidth(path: Path, threads: int = 8) -> float:
    """The I/O bound's rate: the faster of the store's cold reads through the page cache and
    uncached (``read_bandwidth``, ``pread`` and ``direct``), bytes/s. Either way can be the
    faster on a given disk, and a decode through one must not beat the bound by the other."""
    return max(
        read_bandwidth(path, threads=threads, io_mode=m, warm=False)[0] for m in ("pread", "direct")
    )
