"""The seams of the cache: a layer's ``Book`` (which expert sits in which slot, and who keeps
that), the ``SlotTable`` (the device-side table, the optional CUDA wing, which answers decode
calls on the GPU) and ``LayerStaging`` (CUDA's page-locked staging of a prefill's whole layers).
``cache/`` never imports ``cuda/``: the runtime hands them in."""

from __future__ import annotations

from typing import Callable, Dict, List, Protocol, Tuple, Union

import mlx.core as mx
import numpy as np

from ..counters import LayerStats, Stats
from ..format.layout import ExpertLayout
from .pool import ExpertPool, SlotPool


class Book(Protocol):
    """A partly cached layer's slot bookkeeping, asked by the host-synced path."""

    @property
    def slot_of(self) -> np.ndarray:
        """expert -> slot, -1 where absent."""
        ...

    def admit(self, experts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """``(missing, victims)``: which of ``experts`` must be read, into which slots (freed)."""
        ...

    def assigned(self, missing: np.ndarray, victims: np.ndarray) -> None:
        """``missing`` landed in ``victims``."""
        ...

    def release(self, missing: np.ndarray) -> None:
        """A read or write of ``missing`` failed after they were admitted (victims freed)."""
        ...

    def observe(self, rows: np.ndarray) -> None:
        """Learn from ``rows`` (``[n, top_k]``, calls not served here); no slot changes."""
        ...

    def write(self, pool: SlotPool, slots: np.ndarray, blobs: np.ndarray, stats: LayerStats):
        """Put ``blobs`` into ``slots`` of ``pool``."""
        ...

    def settle(self) -> None:
        """Wait until nothing else can change the layer's slots (before they are copied)."""
        ...


# what a layer call computes once its slots are known: (x, slots, pool) -> out
Compute = Callable[[mx.array, mx.array, ExpertPool], mx.array]

# a speculative pass served by the table: WHOLE_PASS (one call), or each token's indices
WHOLE_PASS = "whole"
PassPlan = Union[str, List[mx.array], None]


class SlotTable(Protocol):
    """The device-side slot table (``cuda.table_cache``): decode calls of the layers it serves
    look their slots up on the GPU, with no host sync; only the GPU waits, on misses."""

    def serves(self, layer: int, indices: mx.array) -> bool:
        """Whether the table answers this (one-token) call."""
        ...

    def lookup(
        self, layer: int, indices: mx.array, stats: LayerStats, outside: bool = False
    ) -> Tuple[mx.array, ExpertPool]:
        """Lazy slots for ``indices`` and the pool they index. ``outside`` (a whole speculative
        pass only): the slots may name experts outside the pool, and the pool says where."""
        ...

    def computed(self, out: mx.array) -> None:
        """``out`` reads the slots just looked up: the next table call's lookup runs after it."""
        ...

    def plan_pass(self, layer: int, indices: mx.array, outside: bool) -> PassPlan:
        """How the table serves a pass verifying draft tokens: ``WHOLE_PASS``, a lookup per
        token (their indices, in order), or None (not the table's: the host-synced path)."""
        ...

    def check(self) -> None: ...

    def settle(self, stats: Stats) -> None: ...

    def close(self) -> None: ...


class LayerStaging(Protocol):
    """Page-locked host buffers that a prefill's whole layers are read into, and copied to the
    device out of (``cuda.layer_copy.PinnedStaging``): a few, reused layer after layer."""

    BUFFERS: int

    @property
    def nbytes(self) -> int:
        """The bytes held."""
        ...

    def buffer(self, i: int, n: int, blob_size: int) -> np.ndarray:
        """Buffer ``i`` as a ``[n, blob_size]`` host view to read a layer into (every copy out
        of it has landed: ``copy`` returns only then)."""
        ...

    def copy(self, i: int, layout: ExpertLayout, what: str) -> Dict[str, mx.array]:
        """The layer in buffer ``i``, each component as a device array, the copies landed
        (``what`` names the layer for errors)."""
        ...

    def close(self) -> None: ...
