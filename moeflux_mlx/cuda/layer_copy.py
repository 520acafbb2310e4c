"""A prefill's whole layer from page-locked host memory to the device, by the GPU's copy engine
(used by ``cache.whole_layer`` on CUDA).

A prefill at a small budget moves every expert of a layer to the device while the previous layer
computes. The bytes come from page-locked host memory: the expert files themselves where they
are pinned (``pinned_files``), else ``PinnedStaging``, two buffers of a layer each that the
store's read threads fill. ``cudaMemcpy2DAsync`` on a stream of its own moves each component at
the link's rate (51 GB/s on an H200's PCIe 5, ``benchmarks/transfer.py``) and takes no SM:
a copy kernel on a few blocks moved 47-48 GB/s alone, but beside a prefill's matmuls the two
took 14.4 ms where they took 9.2 and 7.4 alone.

MLX cannot wait for a stream it does not own, so the host does: ``copy_layer`` returns
once its copies have landed, and only then can MLX see the arrays. The caller queues the
previous layer's computation first, so the copy runs beside it (all but the one-thread kernel
that makes the destination arrays, which may wait for an SM behind that computation). The
destination arrays are new MLX arrays for each layer, never written again: a lazy output that
still reads a layer (one nobody evaluated yet) stays correct.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..compute.kernel_source import custom_kernel, load_source, text_digest
from ..errors import DeviceCopyError, DeviceSetupError
from ..format.layout import ExpertLayout
from . import runtime
from .pinned_files import LayerSources

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the addresses (unified addressing)
NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit order with the legacy default stream


def copy_layer(sources: LayerSources, layout: ExpertLayout, what: str) -> Dict[str, mx.array]:
    """Each component of a layer's every expert as a ``[n, nbytes]`` uint8 device array, copied
    out of page-locked ``sources`` by the copy engine; returns once the copies have landed.
    Without CUDA's runtime (tests, the CPU) the same bytes are copied from the host rows.

    Who writes what, and when: the copies write into arrays made here, by a kernel that only
    reports their addresses (asking MLX for an array's address from the host would move it to
    managed memory and synchronize the device), and land before the arrays are returned:
    nothing else holds them before, nothing writes them after. This relies on MLX handing a
    buffer to a new array only once the work that last used it has finished, as its allocator
    does for every stream.

    Args:
        sources: where the layer's components lie in page-locked memory.
        layout: the layer's expert layout.
        what: the layer, for errors (``"layer 12"``).

    Returns:
        The arrays by component name.

    Raises:
        DeviceSetupError: CUDA refused a stream for the copies.
        DeviceCopyError: a copy failed.
    """
    n, rt = layout.num_experts, runtime._cudart()
    if rt is None or not all(sources.device_ptrs):
        return {
            c.name: mx.array(np.ascontiguousarray(rows))
            for c, rows in zip(layout.components, sources.rows)
        }
    lib, stream = rt[0], _copy_stream()
    # Made on a stream of their own, not queued behind the computation on the default one. The
    # kernel may still wait for a free SM behind that computation's kernels: part of the host's
    # wait in this function (benchmarks/prefill.py's "copy to device") is that.
    with mx.stream(_address_stream()):
        tick = mx.array(0, mx.uint32)
        made = {
            c.name: _address_kernel()(
                inputs=[tick],
                output_shapes=[(n, c.nbytes), (1,)],
                output_dtypes=[mx.uint8, mx.uint64],
                grid=(1, 1, 1),
                threadgroup=(1, 1, 1),
            )
            for c in layout.components
        }
    mx.eval(list(made.values()))
    failed = None
    for c, src, stride in zip(layout.components, sources.device_ptrs, sources.strides):
        dst = int(np.array(made[c.name][1])[0])  # device memory, where MLX put it
        if stride == c.nbytes:  # one run
            call = "cudaMemcpyAsync"
            err = lib.cudaMemcpyAsync(
                ctypes.c_void_p(dst),
                ctypes.c_void_p(src),
                ctypes.c_size_t(n * c.nbytes),
                MEMCPY_DEFAULT,
                stream,
            )
        else:  # a row of each expert
            call = "cudaMemcpy2DAsync"
            err = lib.cudaMemcpy2DAsync(
                ctypes.c_void_p(dst),
                ctypes.c_size_t(c.nbytes),
                ctypes.c_void_p(src),
                ctypes.c_size_t(stride),
                ctypes.c_size_t(c.nbytes),
                ctypes.c_size_t(n),
                MEMCPY_DEFAULT,
                stream,
            )
        if err:
            failed = f"{call} of {c.name}: {_error_text(lib, err)}"
            break
    err = lib.cudaStreamSynchronize(stream)  # even after a refusal: nothing left in flight
    if err and failed is None:
        failed = f"waiting for the copies: {_error_text(lib, err)}"
    if failed is not None:
        raise DeviceCopyError(
            f"{what}: copying the experts to the device failed ({failed}); load the model again"
        )
    return {name: arrays[0] for name, arrays in made.items()}


def _error_text(lib, err: int) -> str:
    """CUDA's own words for error ``err`` (its number where the runtime has none)."""
    try:
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        text = lib.cudaGetErrorString(err)
    except AttributeError:
        text = None
    return text.decode() if text else f"error {err}"


@functools.cache
def _copy_stream() -> ctypes.c_void_p:
    """The process's stream for the copy engine, made once (as MLX makes its own streams)."""
    stream = ctypes.c_void_p()
    err = runtime._cudart()[0].cudaStreamCreateWithFlags(ctypes.byref(stream), NON_BLOCKING)
    if err:
        raise DeviceSetupError(f"cudaStreamCreateWithFlags failed (error {err})")
    return stream


@functools.cache
def _address_stream() -> mx.Stream:
    """The GPU stream the copies' destination arrays are made on (``_address_kernel``)."""
    return mx.new_stream(mx.gpu)


@functools.cache
def _address_kernel():
    """A new uint8 array and its device address, nothing written into it
    (``address_cuda.cuh``)."""
    body = load_source("address_cuda.cuh")
    return custom_kernel(
        mx.fast.cuda_kernel,
        name=f"moeflux_address_{text_digest('', body)}",
        input_names=["tick"],
        output_names=["out", "addr"],
        source=body,
    )


class PinnedStaging:
    """Page-locked host buffers a prefill's whole layers are read into (``cache.protocol.
    LayerStaging``), copied to the device by the copy engine (``copy_layer``): at most
    ``BUFFERS`` buffers, each as large as the largest layer read so far (``nbytes`` says how
    much is held).

    Who writes what, and when: buffer ``i`` is written by the store's read threads only after
    the copies out of it have landed (``copy`` returns then); ``buffer`` may then replace it with
    a larger one. Without CUDA's runtime the buffers are plain shared memory, copied through
    host rows.
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

    def copy(self, i: int, layout: ExpertLayout, what: str) -> Dict[str, mx.array]:
        """Each component of the layer read into buffer ``i`` as a device array, landed
        (``copy_layer``; ``what`` names the layer for errors)."""
        buf = self._bufs[i]
        assert buf is not None
        n, size = self._shape[i]
        rows = buf.array[: n * size].reshape(n, size)
        sources = LayerSources(
            [buf.device_ptr + c.offset if buf.device_ptr else 0 for c in layout.components],
            [size] * len(layout.components),
            [rows[:, c.offset : c.offset + c.nbytes] for c in layout.components],
        )
        return copy_layer(sources, layout, what)

    def close(self) -> None:
        """Unlock and free the buffers (no copy out of them is under way: each ``copy``
        waits for its own)."""
        bufs, self._bufs = self._bufs, [None] * self.BUFFERS
        for b in bufs:
            if b is not None:
                b.close()
