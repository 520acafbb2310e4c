"""Expert slots in MLX memory: ``SlotPool`` (the bytes, written from disk reads) and
``ExpertPool`` (typed views of them, what the expert computation reads).

A ``SlotPool`` holds, per component, one uint8 MLX array ``[n_slots, nbytes]`` plus typed views
of it for the kernels. On Metal and the CPU, experts read from disk are copied into their slots
through a writable host view of that very memory ("host" writes): no ``mx.array`` copy, no
scatter. On CUDA, where that memory is managed and lives on the GPU, they are read into
host-resident staging and scattered into the slots by the GPU ("device" writes; the staging's
memory comes from ``cuda.runtime``, handed in by the cache factory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..counters import LayerStats
from ..format.layout import ExpertLayout, Quantization

MX_DTYPES = {
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "F32": mx.float32,
    "BOOL": mx.bool_,
}
STAGING_KEEP_BYTES = 256 << 20  # larger staging and staging pools (prefill) are not kept
# A slot with this bit set names expert ``slot - IN_PLACE_BIT`` outside the pool, read where it
# lies (``InPlaceExperts``): a speculative pass larger than a layer's slots, on a layer whose
# expert files the GPU reads in place (``cuda.pinned_files``).
IN_PLACE_BIT = 1 << 31


def host_view(arr: mx.array) -> np.ndarray:
    """A writable uint8 numpy view of an evaluated, row-contiguous MLX array's memory."""
    return np.frombuffer(memoryview(arr), np.uint8).reshape(arr.shape[0], -1)  # type: ignore[arg-type]


@dataclass
class ExpertPool:
    """Expert weights resident in MLX memory: ``arrays[name]`` is ``[n_slots, *shape]``."""

    arrays: Dict[str, mx.array]
    quantization: Optional[Quantization]  # of gate/up (fc1)
    # projections quantized otherwise: their Quantization, or None where one is not quantized
    overrides: Dict[str, Optional[Quantization]] = field(default_factory=dict)
    # per call shape, what a backend worked out once for this pool (compute.kernels.KernelBackend)
    plans: Dict[tuple, object] = field(default_factory=dict, repr=False, compare=False)
    # where the experts outside the pool lie, for slots with IN_PLACE_BIT (None: no slot has it)
    in_place: Optional[InPlaceExperts] = field(default=None, repr=False, compare=False)

    def quant(self, projection: str) -> Optional[Quantization]:
        return self.overrides.get(projection, self.quantization)

    @classmethod
    def from_blobs(cls, blobs: mx.array, layout: ExpertLayout) -> ExpertPool:
        """Typed views of ``[n, blob_size]`` uint8 blobs, one array per component."""
        n = blobs.shape[0]
        arrays = {}
        for c in layout.components:
            raw = blobs[:, c.offset : c.offset + c.nbytes]
            arrays[c.name] = raw.view(MX_DTYPES[c.dtype]).reshape(n, *c.shape)
        return cls(arrays, layout.quantization, layout.overrides)

    @property
    def is_glu(self) -> bool:
        return "gate_proj.weight" in self.arrays


@dataclass
class InPlaceExperts:
    """Where a layer's experts lie outside its pool, for the slots with ``IN_PLACE_BIT``: per
    component, the device address of expert 0's bytes and the stride between experts (what the
    CUDA kernels read over the bus), and the same bytes as host rows ``[num_experts, nbytes]``
    (what plain ops read)."""

    addresses: Dict[str, Tuple[int, int]]
    rows: Dict[str, np.ndarray]
    _words: Dict[tuple, mx.array] = field(default_factory=dict, repr=False)

    @classmethod
    def of_blobs(
        cls, blobs: np.ndarray, device_ptr: int, layout: ExpertLayout
    ) -> Optional[InPlaceExperts]:
        """Experts as rows of a buffer of ``layout``'s blobs (a table's staging: row ``i`` is
        "expert" ``i``), at ``device_ptr`` for the GPU; None where a component's offset or the
        blob size is not a multiple of 4 (the kernels' word loads)."""
        b = layout.blob_size
        if b % 4 or any(c.offset % 4 for c in layout.components):
            return None
        rows = blobs[: blobs.size // b * b].reshape(-1, b)
        return cls(
            {c.name: (device_ptr + c.offset, b) for c in layout.components},
            {c.name: rows[:, c.offset : c.offset + c.nbytes] for c in layout.components},
        )

    def words(self, names: Sequence[str]) -> mx.array:
        """The kernels' ``in_place`` input for the pool inputs ``names``: address and stride
        of each, in that order."""
        key = tuple(names)
        w = self._words.get(key)
        if w is None:
            flat = [v for n in key for v in self.addresses[n]]
            w = self._words[key] = mx.array(np.array(flat, np.uint64))
        return w

    def gathered(self, pool: ExpertPool, slots: mx.array) -> Tuple[ExpertPool, mx.array]:
        """``pool`` with the experts ``slots`` names outside it appended as slots of its own,
        and ``slots`` renumbered to match: plain ops' way to read them (a host sync)."""
        s = np.array(slots).astype(np.int64) & 0xFFFFFFFF  # int32 or uint32 alike
        outside = s >= IN_PLACE_BIT
        if not outside.any():
            return pool, slots
        experts, pos = np.unique(s[outside] - IN_PLACE_BIT, return_inverse=True)
        arrays = {}
        for name, arr in pool.arrays.items():
            extra = mx.array(self.rows[name][experts]).view(arr.dtype)
            arrays[name] = mx.concatenate([arr, extra.reshape(len(experts), *arr.shape[1:])])
        n_slots = next(iter(pool.arrays.values())).shape[0]
        s[outside] = n_slots + pos
        out = ExpertPool(arrays, pool.quantization, pool.overrides)
        return out, mx.array(s.astype(np.uint32)).reshape(slots.shape)


class DeviceStaging:
    """Host-resident staging for device slot writes, one buffer for every layer of a cache.

    Safe to share for the same reason a pool is safe to rewrite (``cache.budget``'s write
    ordering). Requests over ``STAGING_KEEP_BYTES`` (prefill) get a buffer of their own that is
    not kept. ``allocate(shape)``: a uint8 MLX array the GPU reads in place."""

    def __init__(self, allocate: Callable[[tuple], mx.array]):
        self.allocate = allocate
        self._buf: Optional[mx.array] = None

    def get(self, n: int, blob_size: int) -> mx.array:
        nbytes = n * blob_size
        if nbytes > STAGING_KEEP_BYTES:
            return self.allocate((n, blob_size))
        if self._buf is None or self._buf.size < nbytes:
            self._buf = self.allocate((max(nbytes, 1),))
        return self._buf[:nbytes].reshape(n, blob_size)


class SlotPool:
    """``n_slots`` expert slots of one layout in MLX memory.

    "host" writes copy into the pool's memory through a host view (Metal, CPU); "device" writes
    (``staging`` given) go through host-resident staging and a GPU scatter (CUDA)."""

    def __init__(self, layout: ExpertLayout, n_slots: int, staging: Optional[DeviceStaging] = None):
        self.layout, self.n_slots = layout, n_slots
        self.raw = {c.name: mx.zeros((n_slots, c.nbytes), mx.uint8) for c in layout.components}
        mx.eval(list(self.raw.values()))
        self.staging = staging  # None: host writes
        self.device_writes = staging is not None
        self.host = None if self.device_writes else {n: host_view(a) for n, a in self.raw.items()}
        self._staged: Optional[mx.array] = None
        # where the experts outside the slots lie, for calls that may read them (``wide``)
        self.in_place: Optional[InPlaceExperts] = None
        self._wide: Optional[ExpertPool] = None
        self._typed()

    def _typed(self) -> None:
        typed = {
            c.name: self.raw[c.name].view(MX_DTYPES[c.dtype]).reshape(self.n_slots, *c.shape)
            for c in self.layout.components
        }
        if not self.device_writes:
            mx.eval(list(typed.values()))  # views share raw's buffers, written from the host
        self.pool = ExpertPool(typed, self.layout.quantization, self.layout.overrides)
        self._wide = None

    def read_in_place(self, where: Optional[InPlaceExperts]) -> None:
        """From now on calls may name experts outside the pool, which lie at ``where`` (None:
        no more; its views of the files go)."""
        self.in_place, self._wide = where, None

    def wide(self) -> ExpertPool:
        """The pool as a call whose slots may name experts outside it (``IN_PLACE_BIT``) reads
        it: ``pool`` with ``in_place``, and launch plans of its own."""
        assert self.in_place is not None, "no experts outside this pool can be read"
        if self._wide is None:
            p = self.pool
            self._wide = ExpertPool(p.arrays, p.quantization, p.overrides, in_place=self.in_place)
        return self._wide

    @property
    def nbytes(self) -> int:
        return self.n_slots * sum(c.nbytes for c in self.layout.components)

    def read_buffer(self, n: int) -> Optional[np.ndarray]:
        """Where to read ``n`` blobs for the next ``write`` (None: the reader's own buffer)."""
        if self.staging is None:
            return None
        staged = self._staged = self.staging.get(n, self.layout.blob_size)
        return host_view(staged)

    def staged(self, blobs: np.ndarray) -> mx.array:
        """``blobs`` ``[n, blob_size]`` in device-readable staging: the buffer ``read_buffer``
        handed out when they were read into it, else a copy."""
        assert self.staging is not None, "host writes need no staging"
        n = len(blobs)
        src = self._staged
        if src is None or src.shape[0] != n or host_view(src).ctypes.data != blobs.ctypes.data:
            src = self.staging.get(n, self.layout.blob_size)
            host_view(src)[:] = blobs
        self._staged = None
        return src

    def write(self, slots: np.ndarray, blobs: np.ndarray) -> None:
        """Copy ``blobs`` ``[n, blob_size]`` into ``slots``."""
        if self.host is not None:
            for c in self.layout.components:
                self.host[c.name][slots] = blobs[:, c.offset : c.offset + c.nbytes]
            return
        src = self.staged(blobs)
        idx = mx.array(slots.astype(np.uint32))
        del self.pool  # drop the old typed views so the scatters can update in place
        for c in self.layout.components:
            arr = self.raw[c.name]
            arr[idx] = src[:, c.offset : c.offset + c.nbytes]
        self._typed()


def copy_slots(dst: SlotPool, slots: np.ndarray, src: SlotPool, src_slots: np.ndarray) -> None:
    """Copy ``src``'s ``src_slots`` into ``dst``'s ``slots`` (pools of one layout): through host
    views where both are host-written, else on the device (lazy: it reads ``src`` in stream
    order, before any later write of ``src``)."""
    if dst.host is not None and src.host is not None:
        _copy_host(dst, slots, src.host, src_slots)
    else:
        _copy_device(dst, slots, src.raw, src_slots)


def _copy_host(dst: SlotPool, slots: np.ndarray, src: Dict[str, np.ndarray], rows) -> None:
    for c in dst.layout.components:
        dst.host[c.name][slots] = src[c.name][rows]  # type: ignore[index]


def _copy_device(dst: SlotPool, slots: np.ndarray, src: Dict[str, mx.array], rows) -> None:
    idx = mx.array(slots.astype(np.uint32))
    from_idx = mx.array(rows.astype(np.uint32))
    del dst.pool  # drop the old typed views so the scatters can update in place
    for c in dst.layout.components:
        arr = dst.raw[c.name]
        arr[idx] = src[c.name][from_idx]
    dst._typed()


def read_blobs(
    reader, layer: int, experts: np.ndarray, stats: LayerStats, out: Optional[np.ndarray] = None
) -> np.ndarray:
    """``reader.read`` (the store), counted in ``stats``."""
    t0 = time.perf_counter()
    blobs = reader.read(layer, experts, out)
    stats.io_s += time.perf_counter() - t0
    stats.experts_read += len(experts)
    stats.bytes_read += blobs.nbytes
    return blobs


def write_blobs(pool: SlotPool, slots: np.ndarray, blobs: np.ndarray, stats: LayerStats) -> None:
    """``pool.write``, timed in ``stats``."""
    t0 = time.perf_counter()
    pool.write(slots, blobs)
    stats.upload_s += time.perf_counter() - t0
