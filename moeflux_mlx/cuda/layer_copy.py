"""A prefill's whole layer from mapped host staging to the device, on a few of the GPU's blocks
(``DeviceStaging.copy_layer``, used by ``cache.whole_layer`` on CUDA).

A prefill at a small budget moves every expert of a layer to the device while the previous
layer computes. MLX's own copy kernel launches a block for every few kilobytes and so takes
every SM while the bytes cross PCIe: the computation beside it waits. ``layer_copy_cuda.cuh``
keeps ``LAYER_COPY_BLOCKS`` blocks, each thread with ``DEPTH`` loads in flight, enough to fill
the link, and leaves the other SMs to the computation.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Callable, Dict, Optional

import mlx.core as mx
import numpy as np

from ..compute.kernel_source import load_source
from ..format.layout import ExpertLayout
from . import runtime
from .pinned_files import LayerSources

# blocks of THREADS threads: a few of an H100's 132 SMs. 0: always MLX's copy kernel (every SM),
# the fallback a layout not aligned to 16 bytes takes anyway.
LAYER_COPY_BLOCKS = 16
THREADS = 256
DEPTH = 4  # 16-byte loads in flight per thread


def copier() -> Optional[Callable[[mx.array, ExpertLayout], Optional[Dict[str, mx.array]]]]:
    """``copy_layer`` where its kernel can run (MLX's CUDA backend on the GPU), else None."""
    return copy_layer if runtime.table_available() else None


def copy_layer(staged: mx.array, layout: ExpertLayout) -> Optional[Dict[str, mx.array]]:
    """Each component of ``staged`` (``[n, blob_size]`` uint8, in mapped host staging) as a
    ``[n, nbytes]`` uint8 array on the device, copied by ``LAYER_COPY_BLOCKS`` blocks; lazy, on
    the caller's stream.

    Args:
        staged: the layer's blobs, row-contiguous, readable by the GPU in place.
        layout: the layer's expert layout.

    Returns:
        The arrays by component name; None where the kernel does not apply (a component not
        16-byte sized, or ``LAYER_COPY_BLOCKS`` 0): the caller copies with MLX then.
    """
    parts = tuple((c.offset, c.nbytes) for c in layout.components)
    if LAYER_COPY_BLOCKS <= 0 or layout.blob_size % 16 or any(o % 16 or b % 16 for o, b in parts):
        return None
    outs = _kernel(layout.blob_size, parts)(
        inputs=[staged],
        grid=(LAYER_COPY_BLOCKS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(staged.shape[0], b) for _, b in parts],
        output_dtypes=[mx.uint8] * len(parts),
    )
    return {c.name: out for c, out in zip(layout.components, outs)}


@functools.cache
def _kernel(blob_size: int, parts: tuple):
    """The copy kernel for one layout: the components' offsets and sizes are compiled in."""
    stores = "\n      else ".join(
        f"if ({f'r >= {o // 16} && ' if o else ''}r < {(o + b) // 16}) "
        f"reinterpret_cast<uint4*>(o{i})[e * {b // 16} + (r - {o // 16})] = v[u];"
        for i, (o, b) in enumerate(parts)
    )
    header = f"#define MF_BLOB {blob_size}ll\n#define MF_DEPTH {DEPTH}\n"
    body = load_source("layer_copy_cuda.cuh").replace("MF_STORE_COMPONENTS", stores)
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:10]
    return mx.fast.cuda_kernel(
        name=f"moeflux_layer_copy_{digest}",
        input_names=["blobs"],
        output_names=[f"o{i}" for i in range(len(parts))],
        source=body,
        header=header,
    )


def copy_pinned(sources: LayerSources, layout: ExpertLayout) -> Dict[str, mx.array]:
    """Each component of a layer's every expert as a ``[n, nbytes]`` uint8 device array, copied
    by ``LAYER_COPY_BLOCKS`` blocks straight out of the page-locked expert files
    (``pinned_files``), with no host read; lazy, on the caller's stream. A component the kernel
    cannot take (no CUDA, not 16-byte aligned, or ``LAYER_COPY_BLOCKS`` 0) is copied from the
    files' host mapping instead.

    Args:
        sources: where the layer's components lie in the pinned files.
        layout: the layer's expert layout.

    Returns:
        The arrays by component name.
    """
    n, out = layout.num_experts, {}
    kernel = runtime.table_available() and LAYER_COPY_BLOCKS > 0
    for k, (c, ptr, stride, rows) in enumerate(
        zip(layout.components, sources.device_ptrs, sources.strides, sources.rows)
    ):
        if not (kernel and ptr and sources.aligned(k, c.nbytes)):
            out[c.name] = mx.array(np.ascontiguousarray(rows))
            continue
        meta = mx.array(np.array([ptr & 0xFFFFFFFF, ptr >> 32], np.uint32).view(np.int32))
        out[c.name] = _pinned_kernel()(
            inputs=[meta],
            template=[("N", n), ("NB", c.nbytes), ("STRIDE", stride)],
            grid=(LAYER_COPY_BLOCKS * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(n, c.nbytes)],
            output_dtypes=[mx.uint8],
        )[0]
    return out


@functools.cache
def _pinned_kernel():
    header = f"#define MF_DEPTH {DEPTH}\n"
    body = load_source("pinned_copy_cuda.cuh")
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:10]
    return mx.fast.cuda_kernel(
        name=f"moeflux_pinned_copy_{digest}",
        input_names=["meta"],
        output_names=["out"],
        source=body,
        header=header,
    )
