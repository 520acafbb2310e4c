"""What moving a prefill's expert bytes alone would cost on this machine, measured in the run
that the prefill benchmark (``benchmarks/prefill.py``) holds its prefills against.

The copy rate is the one a whole-layer read ends in (``cache.whole_layer``): on CUDA, the copy
engine out of page-locked memory (``cuda.layer_copy.copy_layer``, as from the whole-layer
staging or the pinned expert files); on another GPU (Metal), an ``mx.array`` made from a numpy buffer and
evaluated on the device; on the CPU backend, a memcpy. Each on a buffer of one layer's bytes (a
layer is what a prefill reads at once), best of a few rounds after a warm-up. The disk's rate,
for cold runs, is ``io.bandwidth.read_bandwidth``'s cold pass (the store's own reads).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, Tuple

import mlx.core as mx
import numpy as np

# a copy buffer never takes more than this (a layer of a large model is over a GB)
MAX_COPY_BYTES = 2 << 30
MIN_COPY_BYTES = 1 << 20
EXPERTS = 128  # rows of the timed layer (the Qwen3-30B-A3B shape's experts a layer)


def _best_rate(nbytes: int, once: Callable[[], None], rounds: int) -> float:
    once()  # warm-up: allocations, kernels, first-touch faults
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


def _cuda_copy_rate(nbytes: int, rounds: int) -> Optional[float]:
    """Bytes/s of ``layer_copy.copy_layer`` moving a layer of ``nbytes`` out of a page-locked
    buffer as a prefill moves a packed layer: ``EXPERTS`` rows of fc1/fc2 halves, each half a
    strided copy of a row from every expert. None without CUDA's runtime."""
    if not (hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu):
        return None
    from moeflux_mlx.cuda import layer_copy
    from moeflux_mlx.cuda.pinned_files import LayerSources
    from moeflux_mlx.cuda.runtime import PinnedBuffer, cuda_runtime_available
    from moeflux_mlx.format.layout import ExpertLayout

    if not cuda_runtime_available():
        return None
    half = max(nbytes // EXPERTS // 4 * 2, 2)  # bytes of each BF16 component of an expert
    shape = (EXPERTS, half // 2)
    layout = ExpertLayout.from_tensors(
        {"fc1.weight": ("BF16", shape), "fc2.weight": ("BF16", shape)}, None
    )
    size = EXPERTS * layout.blob_size
    buf = PinnedBuffer(size)
    try:
        rows = buf.array[:size].reshape(EXPERTS, layout.blob_size)
        sources = LayerSources(
            [buf.device_ptr + c.offset for c in layout.components],
            [layout.blob_size] * len(layout.components),
            [rows[:, c.offset : c.offset + c.nbytes] for c in layout.components],
        )

        def once() -> None:
            mx.eval(list(layer_copy.copy_layer(sources, layout, "copy rate").values()))

        return _best_rate(size, once, rounds)
    finally:
        buf.close()


def copy_rate(nbytes: int, rounds: int = 5) -> Tuple[float, str]:
    """(bytes/s, what was timed) of copying ``nbytes`` (clamped to
    [``MIN_COPY_BYTES``, ``MAX_COPY_BYTES``]) the way a prefill's expert bytes reach the
    device here."""
    n = int(min(max(nbytes, MIN_COPY_BYTES), MAX_COPY_BYTES))
    if mx.default_device() == mx.gpu:
        rate = _cuda_copy_rate(n, rounds)
        if rate is not None:
            return rate, "the copy engine out of page-locked memory (layer_copy.copy_layer)"
        src = np.ones(n, np.uint8)

        def pageable() -> None:
            mx.eval(mx.array(src) + mx.array(0, mx.uint8))

        return _best_rate(n, pageable, rounds), "host-to-device copy from pageable memory"
    src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
    return _best_rate(n, lambda: np.copyto(dst, src), rounds), "memcpy"


def disk_rate(path: Path, io_mode: str, threads: int) -> float:
    """The disk's cold rate (bytes/s) for the store's reads of ``path`` in ``io_mode`` (mmap is
    timed as pread: ``read_bandwidth`` takes pread or direct)."""
    from moeflux_mlx.io.bandwidth import read_bandwidth

    mode = "direct" if io_mode == "direct" else "pread"
    return read_bandwidth(path, threads=threads, io_mode=mode, warm=False)[0]


def bound(
    nbytes: float, copy: Tuple[float, str], disk: Optional[float]
) -> Tuple[float, float, str]:
    """(seconds, bytes/s, which rate) of moving ``nbytes`` at the slower of the copy rate and,
    where given (cold runs), the disk's: reads and copies overlap, so the slower one bounds."""
    rate, name = copy
    if disk is not None and disk < rate:
        rate, name = disk, "disk, cold reads"
    return nbytes / rate, rate, name
