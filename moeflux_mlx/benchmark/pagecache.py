"""Cold reads for the benchmarks: which files hold a model's experts, dropping them from the
page cache (once, or continuously from a process of its own), and the disk's random-read
bandwidth at expert size."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Sequence

from ..format.checkpoint import (
    expert_layout,
    is_packed,
    packed_file,
    packed_layout,
    scan_checkpoint,
)


def expert_files(path: Path) -> List[Path]:
    if is_packed(path):
        return [packed_file(path, i) for i in packed_layout(path).layers]
    ckpt = scan_checkpoint(path)
    return sorted({r.file for comps in ckpt.ranges.values() for r in comps.values()})


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


# The dropper's loop, in a process of its own: a thread of the benchmark's process needs the GIL
# every period, so how often it ran depended on what the decoding thread was doing (a decode
# that held the GIL kept its reads warm), and each wake-up took the GIL from the decode being
# timed. It sleeps in select() on stdin, which the benchmark closes to stop it (or dies).
_DROPPER = """
import os, select, sys
period = float(sys.argv[1])
fds = [os.open(f, os.O_RDONLY) for f in sys.argv[2:]]
drops = 0
while not select.select([sys.stdin], [], [], period)[0]:
    for fd in fds:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    drops += 1
print(drops, flush=True)
"""


class PageCacheDropper:
    """Drops the files' pages from the page cache every ``period_s``, in a process of its own,
    for as long as it runs: reads that follow are cold, as if the experts were many times RAM.

    Nothing is excluded from the timed region: the drops run beside the decode, on a core of
    their own, sharing nothing with it but the kernel's page cache. Mapped pages cannot be
    dropped this way (mmap runs are cold only at their start). ``drops``: how many rounds of
    drops it made, known once it has stopped."""

    def __init__(self, files: Sequence[Path], period_s: float = 1e-3):
        self.files, self.period_s = list(files), period_s
        self.drops = 0
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self):
        drop_page_cache(self.files)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _DROPPER, str(self.period_s), *map(str, self.files)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return self

    def __exit__(self, *exc):
        proc, self._proc = self._proc, None
        try:
            out, _ = proc.communicate(timeout=10)  # closes its stdin: the signal to stop
        except subprocess.TimeoutExpired:
            proc.kill()  # never left behind dropping pages
            proc.wait()
            raise
        if proc.returncode:
            raise RuntimeError(f"the page-cache dropper failed (exit code {proc.returncode})")
        self.drops = int(out.split()[-1])


def read_bandwidth(path: Path, reads: int = 256, threads: int = 8, seed: int = 0):
    """Bytes/s of random expert-sized reads: (cold, after dropping the page cache; warm, the
    same reads again from the page cache)."""
    files = expert_files(path)
    blob = next(iter(expert_layout(path).layers.values())).blob_size
    drop_page_cache(files)
    rng = random.Random(seed)
    jobs = []
    for _ in range(reads):
        f = rng.choice(files)
        size = f.stat().st_size
        jobs.append((f, rng.randrange(0, max(1, size - blob)) // 4096 * 4096))
    fds = {f: os.open(f, os.O_RDONLY) for f in files}

    def one(job):
        buf = bytearray(blob)
        return os.preadv(fds[job[0]], [buf], job[1])

    try:
        rates = []
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(2):
                t = time.perf_counter()
                total = sum(pool.map(one, jobs))
                rates.append(total / (time.perf_counter() - t))
        return tuple(rates)
    finally:
        for fd in fds.values():
            os.close(fd)
