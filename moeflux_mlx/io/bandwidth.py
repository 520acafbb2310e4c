"""The disk's rate for the store's reads of whole experts, and cold reads: which files hold a
model's experts, and dropping their pages from the page cache, once (``drop_page_cache``) or all
along from a process of its own (``PageCacheDropper``). ``moeflux-mlx doctor`` measures with these;
the benchmarks build on them."""

from __future__ import annotations

import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..format.checkpoint import is_packed, packed_file, packed_layout, scan_checkpoint
from .store import open_store


def expert_files(path: Path) -> List[Path]:
    """The files that hold a checkpoint's experts.

    Args:
        path: a converted directory (its packed expert files) or a plain mlx-lm checkpoint (the
            safetensors files any expert tensor lies in).

    Returns:
        The files, sorted for a plain checkpoint, in layer order for a converted one.

    Raises:
        CheckpointError: the checkpoint cannot be scanned.
    """
    if is_packed(path):
        return [packed_file(path, i) for i in packed_layout(path).layers]
    ckpt = scan_checkpoint(path)
    return sorted({r.file for comps in ckpt.ranges.values() for r in comps.values()})


def drop_page_cache(files: Sequence[Path]) -> None:
    """Evict the files' pages from the OS page cache (clean pages; no root needed on Linux).
    Dirty pages cannot be dropped: a file just written (a model converted a moment ago) is
    flushed first.

    Args:
        files: the files whose pages to drop.

    Raises:
        OSError: a file cannot be opened.
        AttributeError: no ``os.posix_fadvise`` here (macOS).
    """
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


class HelperProcess:
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


class PageCacheDropper(HelperProcess):
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
    overlap, and the bytes the page cache then serves would count as the disk's. The "I/O
    bound" that docs/results.md holds cold decode against is this rate.

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
