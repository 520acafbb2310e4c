"""What the streaming module asks a cache, and nothing more.

One question per call: ``lookup(layer, x, indices, stats)`` -> ``(slots, pool)``: the slots of
the routed experts, resident by the time the returned (lazy) arrays are evaluated, and the pool
they live in. Whether a host sync, the device-side table or full residency answers it is the
cache's business. Then ``computed(out)`` tells the cache which computation reads those slots, so
that no later write overtakes it. Before them, for a call verifying draft tokens
(``StreamingRuntime.verifying_drafts``), ``waves(layer, indices)`` may split it into a lookup and
a computation per token (the device-side table serves such a pass so, unless its selections
all fit the layer's slots at once: then the lookup that follows serves it as one call).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Tuple

import mlx.core as mx
import numpy as np

from ..stats import LayerStats, Stats
from .pool import ExpertPool

# (layer, x, k) -> (next MoE layer, its predicted experts, lazy) or None: see model.predict
Predictor = Callable[[int, mx.array, int], Optional[Tuple[int, mx.array]]]


class ExpertCache(Protocol):
    name: str  # "staging", the eviction policy's name ("decay", "lru", ...) or "table"
    predictor: Optional[Predictor]  # set by the runtime when prefetch is on

    def lookup(
        self, layer: int, x: mx.array, indices: mx.array, stats: LayerStats
    ) -> Tuple[mx.array, ExpertPool]:
        """Slots for ``indices`` (the router's ``[..., k]``) and the pool they index."""
        ...

    def waves(
        self, layer: int, indices: mx.array, outside: bool = False
    ) -> Optional[List[mx.array]]:
        """None: ``lookup`` takes the whole call. Else each token's indices (``[1, k]``, in
        order), to be looked up and computed one after the other. ``outside``: the expert
        computation reads slots that name experts outside the pool (``pool.IN_PLACE_BIT``)
        without a host sync, so ``lookup`` may return such slots for this call."""
        ...

    def computed(self, out: mx.array) -> None:
        """``out`` is the computation that reads the slots ``lookup`` just returned."""
        ...

    def absent(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Those of ``experts`` a lookup would have to read."""
        ...

    def check(self) -> None:
        """Raise what went wrong out of band since the last call (device-side table)."""
        ...

    def settle(self, stats: Stats) -> None:
        """Wait for enqueued work and count what was read out of band in ``stats``."""
        ...

    def close(self) -> None: ...
