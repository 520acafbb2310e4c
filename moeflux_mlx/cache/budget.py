"""``BudgetCache``: expert slots under a byte budget, split over layers by their size.

A layer whose budget holds all its experts is filled once, on first use, with slot = expert id,
and from then on its router indices go to the kernels unchanged, with no host sync at all. A
layer with fewer slots than experts keeps the most useful ones by its eviction policy
(``cache.policy``), answering each call with one host sync (``cache.synced``: the write ordering
that keeps a pool from changing under a pending read is explained there).

Who writes what: the slot pools are written only by ``fetch`` (and ``_fill_layer``), on the
model's thread, after the host sync of the call that needs the bytes; the policy's bookkeeping
is changed only by ``_admit`` / ``_assigned`` / ``_release`` (subclasses may hand it to another
owner, e.g. the device-side table's miss server).
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple, Type

import mlx.core as mx
import numpy as np

from ..format.layout import ModelLayout
from ..io.prefetch import Prefetcher
from ..io.store import ExpertStore
from ..stats import LayerStats
from .policy import EvictionPolicy, LRUPolicy
from .pool import (
    DeviceStaging,
    ExpertPool,
    SlotPool,
    copy_from_whole,
    read_blobs,
    write_blobs,
)
from .staging import StagingCache
from .synced import HostSyncCache

log = logging.getLogger(__name__)

FILL_CHUNK_BYTES = 64 << 20


def slots_per_layer(layout: ModelLayout, budget_bytes: int) -> Dict[int, int]:
    """The budget split over the MoE layers in proportion to their expert bytes."""
    total = layout.total_expert_bytes
    out = {}
    for i, lay in layout.layers.items():
        share = budget_bytes * lay.layer_bytes / total if total else 0
        out[i] = int(min(lay.num_experts, share // lay.blob_size))
    return out


class BudgetCache(HostSyncCache):
    """Slot pools under a byte budget, split over layers by their size; eviction by ``policy``.

    ``staging``: device slot writes (CUDA), else host writes. ``prefetcher``,
    ``prefill_whole_layer``, ``prefill_read_ahead``: see ``HostSyncCache``;
    ``prefill_warm_slots``: see ``warm_slots`` (``LoadOptions.prefill_warm_slots``);
    ``prefill_learns``: see ``observe_prefill`` (``LoadOptions.prefill_learns``)."""

    name = "decay"  # the eviction policy's name (set per instance)

    def __init__(
        self,
        store: ExpertStore,
        layout: ModelLayout,
        budget_bytes: int,
        staging: Optional[DeviceStaging] = None,
        prefetcher: Optional[Prefetcher] = None,
        policy: Type[EvictionPolicy] = LRUPolicy,
        prefill_whole_layer: Optional[float] = None,
        prefill_read_ahead: bool = True,
        prefill_warm_slots: bool = False,
        prefill_learns: bool = True,
    ):
        super().__init__(store, prefetcher, prefill_whole_layer, staging, prefill_read_ahead)
        self.prefill_warm_slots = prefill_warm_slots
        self.prefill_learns = prefill_learns
        self.budget_bytes = budget_bytes
        self.n_slots = slots_per_layer(layout, budget_bytes)
        self.policy_class = policy
        self.name = policy.name
        self.pools: Dict[int, SlotPool] = {}  # allocated on a layer's first use
        self.policies: Dict[int, EvictionPolicy] = {}  # partially cached layers kept here
        self.resident: Dict[int, ExpertPool] = {}
        # synced calls routing more experts than slots; never whole-layer reads (this cache's own)
        self.overflow = StagingCache(store, staging, prefetcher, prefill_whole_layer=0)

    @property
    def capacity_bytes(self) -> int:
        return sum(n * self.store.layout(i).blob_size for i, n in self.n_slots.items())

    def resident_pool(self, layer: int) -> Optional[ExpertPool]:
        return self.resident.get(layer)

    def slot_count(self, layer: int) -> int:
        return self.n_slots[layer]

    def slot_of(self, layer: int) -> Optional[np.ndarray]:
        """expert -> slot (-1: absent) of a partially cached layer, once it was used."""
        policy = self.policies.get(layer)
        return None if policy is None else policy.slot_of

    def absent(self, layer: int, experts: np.ndarray) -> np.ndarray:
        if layer in self.resident:
            return experts[:0]
        slot_of = self.slot_of(layer)
        return experts if slot_of is None else experts[slot_of[experts] < 0]

    # -- hooks for a subclass that keeps the bookkeeping elsewhere ---------------------------

    def _fills_whole(self, layer: int) -> bool:
        """Whether the layer is read whole at first use and then needs no lookup."""
        return self.n_slots[layer] == self.store.layout(layer).num_experts

    def _admit(self, layer: int, experts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        policy = self.policies[layer]
        policy.clock[0] += 1
        return policy.admit(experts, int(policy.clock[0]))

    def _assigned(self, layer: int, missing: np.ndarray, victims: np.ndarray) -> None:
        policy = self.policies[layer]
        policy.assign(missing, victims, int(policy.clock[0]))

    def _release(self, layer: int, missing: np.ndarray) -> None:
        """A read or write of ``missing`` failed after they were admitted (their victims freed)."""

    def _observe(self, layer: int, rows: np.ndarray) -> None:
        """The layer's policy learns from ``rows`` (calls it did not serve); its clock moves on
        by as many calls."""
        policy = self._policy(layer)
        policy.observe(rows, int(policy.clock[0]) + 1)
        policy.clock[0] += len(rows)

    def _write(
        self, layer: int, pool: SlotPool, slots: np.ndarray, blobs: np.ndarray, stats: LayerStats
    ) -> None:
        write_blobs(pool, slots, blobs, stats)

    def _copy_in(
        self, layer: int, pool: SlotPool, slots: np.ndarray, whole: ExpertPool, experts: np.ndarray
    ) -> None:
        """Copy ``experts`` of a whole-layer pool into ``slots`` (``warm_slots``)."""
        copy_from_whole(pool, slots, whole, experts)

    # -----------------------------------------------------------------------------------------

    def _pool(self, layer: int) -> SlotPool:
        pool = self.pools.get(layer)
        if pool is None:
            n_slots, layout = self.n_slots[layer], self.store.layout(layer)
            pool = self.pools[layer] = SlotPool(layout, n_slots, self.staging)
            if not self._fills_whole(layer) and self._keeps_policy(layer):
                self._policy(layer)
        return pool

    def _policy(self, layer: int) -> EvictionPolicy:
        """The partially cached layer's policy, made on first use (before its slots, when a
        prefill teaches it: ``observe_prefill``)."""
        policy = self.policies.get(layer)
        if policy is None:
            num = self.store.layout(layer).num_experts
            policy = self.policies[layer] = self.policy_class(num, self.n_slots[layer])
        return policy

    def _keeps_policy(self, layer: int) -> bool:
        return True

    def fetch(
        self, layer: int, experts: np.ndarray, stats: LayerStats
    ) -> Tuple[np.ndarray, ExpertPool]:
        if len(experts) > self.n_slots[layer]:
            # more experts than slots (a speculative pass, a short prefill on a small budget):
            # staged uncached, those the slots hold copied from them, only the others read
            return self.overflow.fetch(layer, experts, stats, self._held(layer, experts))
        pool = self._pool(layer)
        if self._fills_whole(layer):
            self._fill_layer(layer, pool, stats)
            stats.experts_missed += len(experts)
            return experts.astype(np.uint32), pool.pool
        missing, victims = self._admit(layer, experts)
        if missing.size:
            try:
                blobs = read_blobs(
                    self.reader, layer, missing, stats, pool.read_buffer(missing.size)
                )
                self._write(layer, pool, victims, blobs, stats)
            except BaseException:  # the victims were freed: nothing claims bytes that never came
                self._release(layer, missing)
                raise
            self._assigned(layer, missing, victims)
            stats.experts_missed += missing.size
        slot_of = self.slot_of(layer)
        assert slot_of is not None  # the layer's bookkeeping exists once its pool does
        return slot_of[experts].astype(np.uint32), pool.pool

    def observe_prefill(self, layer: int, rows: np.ndarray) -> None:
        # no slots made here: a pool would be allocated (and waited for) mid-prefill
        if layer in self.resident or self._fills_whole(layer) or not len(rows):
            return
        self._observe(layer, rows)

    def warm_slots(self, layer: int, experts: np.ndarray, whole: ExpertPool) -> None:
        if not experts.size:
            return
        if layer in self.resident or self._fills_whole(layer):
            return
        pool = self._pool(layer)
        missing, victims = self._admit(layer, experts)
        if not missing.size:
            return
        try:
            self._copy_in(layer, pool, victims, whole, missing)
        except BaseException:  # the victims were freed: nothing claims bytes that never came
            self._release(layer, missing)
            raise
        self._assigned(layer, missing, victims)

    def _held(self, layer: int, experts: np.ndarray) -> Optional[Tuple[SlotPool, np.ndarray]]:
        """``(pool, slot per expert or -1)`` of the layer's slots, for a call staged uncached;
        None where they hold none of ``experts``."""
        pool, slot_of = self.pools.get(layer), self.slot_of(layer)
        if pool is None or slot_of is None:
            return None
        slots = slot_of[experts]
        return (pool, slots) if (slots >= 0).any() else None

    def _fill_layer(self, layer: int, pool: SlotPool, stats: LayerStats) -> None:
        """Read the whole layer once, in bounded chunks; afterwards slot == expert id."""
        n = pool.layout.num_experts
        step = max(1, FILL_CHUNK_BYTES // pool.layout.blob_size)
        for e0 in range(0, n, step):
            experts = np.arange(e0, min(e0 + step, n))
            blobs = read_blobs(self.reader, layer, experts, stats, pool.read_buffer(len(experts)))
            write_blobs(pool, experts, blobs, stats)
            if pool.device_writes:
                mx.eval(list(pool.raw.values()))  # before the staging buffer is reused
        self.resident[layer] = pool.pool

    def close(self) -> None:
        super().close()
        self.pools.clear()
        self.resident.clear()
        self.overflow.close()
