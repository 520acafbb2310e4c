"""The device-side slot table: decode without a host sync per MoE layer (CUDA).

With a host sync per layer the GPU idles while Python builds each layer's graph, and Python idles
while the GPU runs it (0.6-0.8 ms per layer on an H100). Here the
expert -> slot table of each partially cached layer lives in a control block of shared memory
that the GPU reads in place (``control_block.py``), and each decode call enqueues:

- ``resolve`` (one block): looks the router's experts up in the table. All resident: it writes
  their slots and the host never hears of it. A miss: it publishes the request in the control
  block and waits, on the GPU, for the miss server to read the missing experts into the
  staging, pick victims (LRU) and update the table; then it reads the table again.
- ``fill``: copies what the server read from the staging into the victims' pool slots.
- the expert kernels (``compute``), on those slots.

So a token's whole graph is built and enqueued at once, as mlx-lm does for stock models, and only
the GPU waits, only on misses. Decode-sized calls (one token) take this path; prefill keeps the
synced one (``TableCache.fetch``), which asks the server to admit experts into the same
table (a host request) and writes them itself.

The miss server is a helper process (``miss_server.py``, started by ``miss_client.py``): a
thread of this process cannot be relied on to answer, because MLX can block this process's thread
inside ``mx.async_eval`` while holding the GIL, for the whole of the GPU's wait
(``miss_server.py`` says more).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional

import mlx.core as mx
import numpy as np

from ..compute.kernel_source import Kernel, custom_kernel, load_source, text_digest
from ..format.layout import ExpertLayout
from .control_block import (
    FAULT_INDEX,
    FAULT_TIMEOUT,
    H_ERR,
    H_HINT_N,
    H_HINT_TICK,
    H_HOST_TICKS,
    H_NCOPY,
    H_NREQ,
    H_WAIT_US,
    H_WAITS,
    MAX_SELECTIONS,
    META_CTRL,
    META_HINT,
    META_SOURCES,
    META_STAGING,
    ControlBlock,
)
from .runtime import PinnedBuffer

if TYPE_CHECKING:
    from .pinned_files import LayerSources

log = logging.getLogger(__name__)

FILL_BLOCKS, FILL_THREADS = 132, 256
# resolve's ``in_place``: where the experts a pass leaves out of the slots are read
IN_FILES, IN_STAGING = 1, 2


def _meta(control: ControlBlock, staging: PinnedBuffer, layer: int) -> mx.array:
    """``_make_meta``, made once per layer."""
    launches = control.layers[layer].launches
    if "meta" not in launches:
        launches["meta"] = _make_meta(control, staging, layer)
    return launches["meta"]


def _make_meta(control: ControlBlock, staging: PinnedBuffer, layer: int) -> mx.array:
    """The kernels' view of a layer (``control_block.META``): its words' offsets in the control
    block (resolve_cuda.cuh reads them by position), the control block's and the staging's
    device addresses, where its hint goes (hint_cuda.cuh), then with pinned files where each
    component's experts lie."""
    t = control.layers[layer]
    if not isinstance(control.buffer, PinnedBuffer):
        raise TypeError("the kernels need a control block made with allocate=PinnedBuffer")
    sources = t.sources.device_ptrs if t.sources is not None else ()  # from META_SOURCES
    meta = mx.array(t.words.meta(control.buffer.device_ptr, staging.device_ptr, sources))
    mx.eval(meta)
    return meta


# ---------------------------------------------------------------------------------------------
# Kernels (CUDA only: the GPU waits on host memory; Metal keeps the synced path)


def _defines(**values) -> str:
    return "".join(f"#define MF_{k} {v}\n" for k, v in values.items())


@functools.cache
def _header(wait_s: float) -> str:
    """Every table kernel's header; ``wait_s``: how long the GPU waits for the miss server
    before it gives up (``DeviceWaitError``)."""
    return (
        load_source("prelude_cuda.cuh")
        + "\n"
        + load_source("moe_common.h")
        + "\n"
        + load_source("table_cuda.cuh")
        + "\n"
        + _defines(
            H_ERR=H_ERR,
            H_NREQ=H_NREQ,
            H_NCOPY=H_NCOPY,
            H_WAITS=H_WAITS,
            H_WAIT_US=H_WAIT_US,
            H_HOST_TICKS=H_HOST_TICKS,
            H_HINT_N=H_HINT_N,
            H_HINT_TICK=H_HINT_TICK,
            FAULT_INDEX=FAULT_INDEX,
            FAULT_TIMEOUT=FAULT_TIMEOUT,
            MAXN=MAX_SELECTIONS,
            WAIT_TIMEOUT_NS=f"{int(wait_s * 1e9)}ull",
            META_CTRL=META_CTRL,
            META_STAGING=META_STAGING,
            META_HINT=META_HINT,
        )
    )


def _named(kind: str, header: str, body: str) -> str:
    return f"moeflux_{kind}_{text_digest(header, body)}"


def _table_kernel(kind: str, wait_s: float, inputs: list, output: str) -> Kernel:
    header, body = _header(wait_s), load_source(f"{kind}_cuda.cuh")
    return custom_kernel(
        mx.fast.cuda_kernel,
        name=_named(kind, header, body),
        input_names=inputs,
        output_names=[output],
        source=body,
        header=header,
    )


@functools.cache
def _hint_kernel(wait_s: float) -> Kernel:
    return _table_kernel("hint", wait_s, ["inds", "pred", "meta"], "out")


@functools.cache
def _resolve_kernel(wait_s: float) -> Kernel:
    return _table_kernel("resolve", wait_s, ["inds", "meta", "after"], "slots")


def _components(layout: ExpertLayout) -> tuple:
    """``(offset, nbytes)`` of each expert component: what a copy kernel compiles in."""
    return tuple((c.offset, c.nbytes) for c in layout.components)


def _warps(n: int) -> int:
    """Threads for a one-block kernel of ``n`` lanes: whole warps."""
    return (max(n, 1) + 31) // 32 * 32


def _flat_u32(a: mx.array) -> mx.array:
    a = a.reshape(-1)
    return a if a.dtype == mx.uint32 else a.astype(mx.uint32)


def _index_array(a: mx.array) -> mx.array:
    """Router indices as resolve reads them (through their strides): no graph node unless the
    dtype is neither uint32 nor int32."""
    return a if a.dtype in (mx.uint32, mx.int32) else a.astype(mx.uint32)


COPY_GRID = dict(grid=(FILL_BLOCKS * FILL_THREADS, 1, 1), threadgroup=(FILL_THREADS, 1, 1))


def _copy_line(i: int, nbytes: int, src: str, aligned: bool) -> str:
    """Component ``i``'s copy (``nbytes`` from ``src``) into its pool slot ``d``."""
    dst = f"const_cast<uint8_t*>(p{i}) + d * {nbytes}ll"
    if aligned:
        return f"    mf_copy_component<{nbytes}ll>({src}, {dst}, poison, gtid, gsize);\n"
    # a safetensors file's tensors need not start 16-byte aligned: byte by byte
    return (
        f"    {{ const volatile uint8_t* sv = {src}; uint8_t* dv = {dst};\n"
        f"      for (size_t i = gtid; i < size_t({nbytes}ll); i += gsize) "
        "dv[i] = poison ? uint8_t(0xFF) : sv[i]; }\n"
    )


def _copy_kernel(
    kind: str,
    first_inputs: list,
    output: str,
    blob_size: int,
    components: tuple,
    wait_s: float,
    strides: Optional[tuple] = None,
) -> Kernel:
    """A kernel copying expert blobs into pool slots (``fill_cuda.cuh``, ``write_cuda.cuh``), one
    per expert layout: the component offsets and sizes (``(offset, nbytes)`` each) are
    compiled in. ``strides`` (fill only): each component's ``(stride, aligned)`` in the pinned
    expert files (``pinned_files``), whose addresses the meta holds: the copy list's sources
    are then expert ids, not staging rows."""
    if strides is None:
        copies = "".join(
            _copy_line(i, nbytes, f"s + {offset}", True)
            for i, (offset, nbytes) in enumerate(components)
        )
    else:
        copies = "".join(
            _copy_line(
                i,
                nbytes,
                f"mf_ptr<const uint8_t>(meta, {META_SOURCES + 2 * i}) + "
                f"size_t(src[k]) * {stride}ll",
                aligned,
            )
            for i, ((_, nbytes), (stride, aligned)) in enumerate(zip(components, strides))
        )
    header = _header(wait_s) + _defines(BLOB=f"{blob_size}ll")
    body = load_source(f"{kind}_cuda.cuh").replace("MF_COPY_COMPONENTS", copies)
    return custom_kernel(
        mx.fast.cuda_kernel,
        name=_named(kind, header, body),
        input_names=[*first_inputs, *[f"p{i}" for i in range(len(components))]],
        output_names=[output],
        source=body,
        header=header,
    )


@functools.cache
def _fill_kernel(
    blob_size: int, components: tuple, wait_s: float, strides: Optional[tuple] = None
) -> Kernel:
    return _copy_kernel(
        "fill", ["slots", "meta"], "out_slots", blob_size, components, wait_s, strides
    )


def _source_strides(sources: Optional[LayerSources], layout: ExpertLayout) -> Optional[tuple]:
    """``_copy_kernel``'s ``strides`` for a layer's pinned ``sources`` (None: none)."""
    if sources is None:
        return None
    return tuple(
        (stride, sources.aligned(k, c.nbytes))
        for k, (stride, c) in enumerate(zip(sources.strides, layout.components))
    )


@functools.cache
def _write_kernel(blob_size: int, components: tuple, wait_s: float) -> Kernel:
    return _copy_kernel("write", ["blobs", "dst"], "done", blob_size, components, wait_s)


def write_in_place(
    blobs: mx.array,
    slots: np.ndarray,
    raw: Dict[str, mx.array],
    layout: ExpertLayout,
    wait_s: float,
) -> mx.array:
    """Copy ``blobs`` ``[n, blob_size]`` into the pool arrays ``raw`` at ``slots``, in place
    (see write_cuda.cuh for why a table layer needs that); lazy: evaluate what it returns."""
    kernel = _write_kernel(layout.blob_size, _components(layout), wait_s)
    dst = mx.array(np.asarray(slots, np.uint32))
    return kernel(
        inputs=[blobs, dst, *[raw[c.name] for c in layout.components]],
        **COPY_GRID,
        output_shapes=[(1,)],
        output_dtypes=[mx.uint32],
    )[0]


@dataclass
class _Launches:
    """A layer's resolve and fill launches for calls of ``n`` experts, worked out once: decode
    makes them once per layer and token."""

    meta: mx.array
    fill: Kernel
    resolve_kwargs: dict
    fill_kwargs: dict

    @classmethod
    def make(
        cls,
        control: ControlBlock,
        staging: PinnedBuffer,
        layer: int,
        layout: ExpertLayout,
        indices: mx.array,
        after: mx.array,
        wait_s: float,
        in_place: int = 0,
    ) -> _Launches:
        n = indices.size
        threads = _warps(n)
        # resolve's output carries one more word: the call's request number (0: all resident),
        # which tells fill whether the copy list is this call's. The input dtypes are template
        # arguments only to tell MLX's kernel cache (by name) one signature from another.
        return cls(
            _meta(control, staging, layer),
            _fill_kernel(
                layout.blob_size,
                _components(layout),
                wait_s,
                _source_strides(control.layers[layer].sources, layout),
            ),
            dict(
                template=[
                    ("N", n),
                    ("IN_PLACE", in_place),
                    ("IDX", indices.dtype),
                    ("AFTER", after.dtype),
                ],
                grid=(threads, 1, 1),
                threadgroup=(threads, 1, 1),
                output_shapes=[(n + 1,)],
                output_dtypes=[mx.uint32],
            ),
            dict(
                template=[("N", n)],
                **COPY_GRID,
                output_shapes=[tuple(indices.shape)],
                output_dtypes=[mx.uint32],
            ),
        )


def hint(
    control: ControlBlock,
    staging: PinnedBuffer,
    layer: int,
    indices: mx.array,
    predicted: mx.array,
    wait_s: float,
) -> mx.array:
    """``indices`` passed on (lazy), once ``predicted`` (the experts the router of ``layer``, the
    next table layer, is predicted to pick) is published for the miss server to read ahead.
    ``wait_s``: the GPU's wait limit (``_header``)."""
    n = indices.size
    if predicted.size > MAX_SELECTIONS:
        raise ValueError(f"a hint names at most {MAX_SELECTIONS} experts, got {predicted.size}")
    kwargs = control.layers[layer].launches.get(("hint", n))
    if kwargs is None:
        threads = _warps(n)
        kwargs = control.layers[layer].launches[("hint", n)] = dict(
            template=[("N", n)],
            grid=(threads, 1, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[(n,)],
            output_dtypes=[mx.uint32],
        )
    out = _hint_kernel(wait_s)(
        inputs=[_flat_u32(indices), _flat_u32(predicted), _meta(control, staging, layer)], **kwargs
    )[0]
    return out.reshape(indices.shape)


def resolve(
    control: ControlBlock,
    staging: PinnedBuffer,
    layer: int,
    indices: mx.array,
    raw: Dict[str, mx.array],
    layout: ExpertLayout,
    wait_s: float,
    after: Optional[mx.array] = None,
    in_place: int = 0,
) -> mx.array:
    """Lazy slots for ``indices`` (one token's experts), made resident on the way (see above).
    ``staging``: where the miss server reads this layout's missed experts. ``after``: the
    previous table call's expert computation, which the lookup must not overtake. MLX's CUDA
    backend runs a graph's kernels concurrently unless one reads a buffer another wrote, and
    these kernels' effects (the table, the staging, the pool) are invisible to it: graphs
    evaluated together (forward passes built, then evaluated at once) would interleave, a
    later call's misses evicting slots an earlier one has yet to read. An input of the lookup
    is an edge. Within one forward pass, and from token to token, the order is implied anyway.
    ``wait_s``: how long the GPU waits for the miss server before it gives up. ``in_place``
    (a pass larger than the slots): what the server leaves out of them comes as
    ``cache.pool.IN_PLACE_BIT | i``, read where it lies: ``IN_FILES``, expert ``i`` of the
    pinned expert files; ``IN_STAGING``, row ``i`` of the staging; 0, nothing is left out.
    """
    t = control.layers[layer]
    indices = _index_array(indices)
    if after is None:
        after = _meta(control, staging, layer)
    key = (tuple(indices.shape), indices.dtype, after.dtype, in_place)
    launch = t.launches.get(key)
    if launch is None:
        launch = t.launches[key] = _Launches.make(
            control, staging, layer, layout, indices, after, wait_s, in_place
        )
    # two graph nodes (decode is host-bound, docs/kernels.md): indices and after go in as they
    # are, and fill's output is declared in the router's shape
    slots = _resolve_kernel(wait_s)(inputs=[indices, launch.meta, after], **launch.resolve_kwargs)[
        0
    ]
    pools = [raw[c.name] for c in layout.components]
    return launch.fill(inputs=[slots, launch.meta, *pools], **launch.fill_kwargs)[0]


# A layout's staging holds a speculative pass's misses up to this size (it is pinned host memory)
PASS_STAGING_BYTES = 128 << 20


def staging_rows(top_k: int, blob_size: int) -> int:
    """Rows of a layout's staging: two tokens' misses (a speculative pass's request admits the
    next token's experts with its own, ``miss_server.Hint``), or as many as the table serves in
    one call (a whole pass, ``TableCache._fits_whole``) within ``PASS_STAGING_BYTES``."""
    return max(
        1, min(2 * top_k, MAX_SELECTIONS), min(MAX_SELECTIONS, PASS_STAGING_BYTES // blob_size)
    )


def fits(n_selected: int, n_slots: int) -> bool:
    """Whether a call routing ``n_selected`` experts can take the table path on a layer with
    ``n_slots`` slots (it needs a slot for each)."""
    return 0 < n_selected <= min(MAX_SELECTIONS, n_slots)
