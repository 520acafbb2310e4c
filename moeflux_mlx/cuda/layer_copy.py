"""A prefill's whole layer from page-locked host memory to the device, on a few of the GPU's
blocks (used by ``cache.whole_layer`` on CUDA).

A prefill at a small budget moves every expert of a layer to the device while the previous layer
computes. The bytes come from page-locked host memory the GPU reads in place: the expert files
themselves where they are pinned (``pinned_files``), else ``PinnedStaging``, two buffers of a
layer each that the store's read threads fill. ``pinned_copy_cuda.cuh`` copies each component
with ``LAYER_COPY_BLOCKS`` blocks, each thread with ``DEPTH`` loads in flight: enough to fill
PCIe (47-48 GB/s on an H200 with 16 to 264 blocks, ``benchmarks/transfer.py``), while MLX's own
copy kernel would take every SM and the computation beside it would wait.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..compute.kernel_source import load_source, text_digest
from ..format.layout import ExpertLayout
from . import runtime
from .pinned_files import LayerSources

# blocks of THREADS threads: a few of an H200's 132 SMs (0: the host fallback, MLX's copies)
LAYER_COPY_BLOCKS = 16
THREADS = 256
DEPTH = 4  # loads in flight per thread
# the kernel's load per width: the widest that the address, the stride and the size divide
_WORDS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


def word_bytes(*values: int) -> int:
    """The widest load (16, 8, 4, 2 or 1 bytes) that every one of ``values`` is a multiple of."""
    return next(w for w in _WORDS if all(v % w == 0 for v in values))


def copy_pinned(sources: LayerSources, layout: ExpertLayout) -> Dict[str, mx.array]:
    """Each component of a layer's every expert as a ``[n, nbytes]`` uint8 device array, copied
    by ``LAYER_COPY_BLOCKS`` blocks straight out of page-locked host memory, with no host read;
    lazy, on the caller's stream. Without the kernel (no CUDA, or ``LAYER_COPY_BLOCKS`` 0) each
    component is copied from the same bytes' host rows instead.

    Args:
        sources: where the layer's components lie in page-locked memory.
        layout: the layer's expert layout.

    Returns:
        The arrays by component name.
    """
    n, out = layout.num_experts, {}
    kernel = runtime.table_available() and LAYER_COPY_BLOCKS > 0
    for c, ptr, stride, rows in zip(
        layout.components, sources.device_ptrs, sources.strides, sources.rows
    ):
        if not (kernel and ptr):
            out[c.name] = mx.array(np.ascontiguousarray(rows))
            continue
        meta = mx.array(np.array([ptr & 0xFFFFFFFF, ptr >> 32], np.uint32).view(np.int32))
        out[c.name] = _kernel(word_bytes(ptr, stride, c.nbytes))(
            inputs=[meta],
            template=[("N", n), ("NB", c.nbytes), ("STRIDE", stride)],
            grid=(LAYER_COPY_BLOCKS * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(n, c.nbytes)],
            output_dtypes=[mx.uint8],
        )[0]
    return out


@functools.cache
def _kernel(word: int):
    header = (
        f"#define MF_DEPTH {DEPTH}\n#define MF_WORD {_WORDS[word]}\n#define MF_WORD_BYTES {word}\n"
    )
    body = load_source("pinned_copy_cuda.cuh")
    return mx.fast.cuda_kernel(
        name=f"moeflux_pinned_copy_{text_digest(header, body)}",
        input_names=["meta"],
        output_names=["out"],
        source=body,
        header=header,
    )


class PinnedStaging:
    """Page-locked host buffers a prefill's whole layers are read into (``cache.protocol.
    LayerStaging``), and the GPU's copy out of them: at most ``BUFFERS``, each as large as the
    largest layer read so far (``nbytes`` says how much is held).

    Who writes what, and when: buffer ``i`` is written by the store's read threads only while
    the caller (``cache.whole_layer``) holds no unevaluated copy out of it; ``buffer`` may then
    replace it with a larger one. Without CUDA's runtime the buffers are plain shared memory and
    ``copy`` copies their host rows.
    """

    BUFFERS = 2

    def __init__(self) -> None:
        self._bufs: List[Optional[runtime.PinnedBuffer]] = [None] * self.BUFFERS
        self._shape: List[tuple] = [(0, 0)] * self.BUFFERS  # (n, blob_size) each holds now

    @property
    def nbytes(self) -> int:
        """The page-locked bytes held."""
        return sum(b.nbytes for b in self._bufs if b is not None)

    def buffer(self, i: int, n: int, blob_size: int) -> np.ndarray:
        """Buffer ``i`` as a ``[n, blob_size]`` host view for a read (grown if too small).

        Raises:
            DeviceSetupError: CUDA refused to page-lock a new buffer.
        """
        nbytes = n * blob_size
        buf = self._bufs[i]
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                self._bufs[i] = None
                buf.close()
            buf = self._bufs[i] = runtime.PinnedBuffer(nbytes)
        self._shape[i] = (n, blob_size)
        return buf.array[:nbytes].reshape(n, blob_size)

    def copy(self, i: int, layout: ExpertLayout) -> Dict[str, mx.array]:
        """Each component of the layer read into buffer ``i`` as a device array (lazy, on the
        caller's stream)."""
        buf = self._bufs[i]
        assert buf is not None
        n, size = self._shape[i]
        rows = buf.array[: n * size].reshape(n, size)
        sources = LayerSources(
            [buf.device_ptr + c.offset if buf.device_ptr else 0 for c in layout.components],
            [size] * len(layout.components),
            [rows[:, c.offset : c.offset + c.nbytes] for c in layout.components],
        )
        return copy_pinned(sources, layout)

    def close(self) -> None:
        """Unlock and free the buffers (after every copy out of them was evaluated)."""
        bufs, self._bufs = self._bufs, [None] * self.BUFFERS
        rt = runtime._cudart()
        if rt is not None and any(b is not None for b in bufs):
            rt[0].cudaDeviceSynchronize()  # no kernel of any stream still reads them
        for b in bufs:
            if b is not None:
                b.close()
