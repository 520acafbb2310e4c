"""``ExpertCache``: what a streaming layer asks for its experts, answered on one of four paths.

``StreamingSwitchGLU`` hands each call to ``call`` (or, for a pass verifying draft tokens, to
``verify_pass``) with the computation to run on the slots it gets:

1. every expert of the layer resident (slot == expert id): the router's indices are the slots;
2. the device-side table (CUDA, a decode call on a partly cached layer): slots looked up on the
   GPU, which waits for the miss server only on misses;
3. a prefill at a small budget: the whole layer read into a pool of its own, no host sync
   (``whole_layer``);
4. otherwise one host sync: the routed experts made resident in the layer's slots
   (``slots``), then computed.

Each path orders its own writes against pending reads; nothing is handed from one call to the
next through this object except the prefill pipeline's held layers (``WholeLayerPrefill``) and
the table's last output (the next table call's ``after``).
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from ..counters import LayerStats, Stats
from ..io.store import ExpertStore
from .pool import DeviceStaging, ExpertPool
from .protocol import Compute, SlotTable
from .slots import SlotCache
from .whole_layer import WholeLayerPrefill


class ExpertCache:
    """The expert cache of one model: its slots, its prefill path and, on CUDA, its table.

    Args:
        store: the expert store.
        slots: the slot pools under the budget.
        whole: the whole-layer prefill path.
        table: the device-side table (None: every partly cached layer is host-synced).
        staging: the device staging the slots write through (closed with the cache).
    """

    def __init__(
        self,
        store: ExpertStore,
        slots: SlotCache,
        whole: WholeLayerPrefill,
        table: Optional[SlotTable] = None,
        staging: Optional[DeviceStaging] = None,
    ):
        self.store, self.slots, self.whole, self.table = store, slots, whole, table
        self.staging = staging

    @property
    def name(self) -> str:
        """What serves partly cached layers: ``table``, the policy's name, or ``staging``
        (nothing resident)."""
        if self.table is not None:
            return "table"
        return self.slots.policy.name if self.slots.capacity_bytes else "staging"

    @property
    def capacity_bytes(self) -> int:
        return self.slots.capacity_bytes

    def call(
        self, layer: int, x: mx.array, indices: mx.array, compute: Compute, stats: LayerStats
    ) -> mx.array:
        """``compute(x, slots, pool)`` for the router's ``indices`` on ``layer``: the four
        paths of a layer call (see the module's text)."""
        self.whole.begin(layer)
        resident = self.slots.resident.get(layer)
        if resident is not None:  # 1. every expert resident, slot == expert id: no host sync
            stats.calls += 1
            stats.unsynced_calls += 1
            stats.resident_calls += 1
            stats.tokens += indices.size // indices.shape[-1]  # the shape needs no sync
            # every selection is a hit; how many there are is in the shape too (a decode call's
            # k selections are its k experts; a prefill's repeat some, each counted, each a hit)
            stats.experts_routed += indices.size
            return compute(x, indices, resident)
        if self.table is not None and self.table.serves(layer, indices):  # 2. on the GPU
            slots, pool = self.table.lookup(layer, indices, stats)
            out = compute(x, slots, pool)
            self.table.computed(out)
            return out
        if self.whole.takes(layer, indices):  # 3. a prefill: the whole layer, no host sync
            whole = self.whole.lookup(layer, indices, stats)
            out = compute(x, indices, whole)
            self.whole.computed(layer, whole, indices, out)
            return out
        slots, pool = self._synced(layer, indices, stats)  # 4. one host sync
        out = compute(x, slots, pool)
        mx.async_eval(out)  # the pool's next write must not overtake this read
        return out

    def verify_pass(
        self,
        layer: int,
        x: mx.array,
        indices: mx.array,
        compute: Compute,
        stats: LayerStats,
        outside: bool,
    ) -> mx.array:
        """A forward pass verifying draft tokens (speculation): where the table serves the layer,
        one table call for the whole pass, or one per token, the first announcing every token's
        experts so the miss server reads their union at once; elsewhere an ordinary ``call``.
        ``outside``: the expert computation reads slots naming experts outside the pool
        (``pool.IN_PLACE_BIT``) without a host sync, so a pass larger than the slots may stay
        one call."""
        table = self.table
        plan = None if table is None else table.plan_pass(layer, indices, outside)
        if table is None or plan is None:
            return self.call(layer, x, indices, compute, stats)
        self.whole.begin(layer)
        if isinstance(plan, str):  # WHOLE_PASS
            slots, pool = table.lookup(layer, indices, stats, outside=outside)
            out = compute(x, slots, pool)
            table.computed(out)
            return out
        rows, outs = x.reshape(-1, x.shape[-1]), []
        for t, wave in enumerate(plan):
            slots, pool = table.lookup(layer, wave, stats)
            outs.append(compute(rows[t : t + 1], slots, pool))
            table.computed(outs[-1])
        out = mx.concatenate(outs)
        return out.reshape(*indices.shape, out.shape[-1])

    def _synced(
        self, layer: int, indices: mx.array, stats: LayerStats
    ) -> Tuple[mx.array, ExpertPool]:
        t0 = time.perf_counter()
        idx = np.array(indices)  # the one host sync per MoE layer: which experts were routed
        t1 = time.perf_counter()
        experts, inverse = np.unique(idx, return_inverse=True)
        self.store.check_experts(layer, experts)
        slot_of, pool = self.slots.fetch(layer, experts, stats)
        stats.calls += 1
        stats.tokens += int(np.prod(idx.shape[:-1]))
        stats.experts_routed += len(experts)
        stats.sync_s += t1 - t0
        return mx.array(slot_of[inverse].reshape(idx.shape)), pool

    def check(self) -> None:
        """Raise what went wrong out of band since the last forward pass (the table)."""
        if self.table is not None:
            self.table.check()

    def settle(self, stats: Stats) -> None:
        """Wait for enqueued work and count what was read out of band in ``stats``."""
        if self.table is not None:
            self.table.settle(stats)

    def close(self) -> None:
        try:
            if self.table is not None:
                self.table.close()
        finally:
            self.whole.close()
            self.slots.close()
