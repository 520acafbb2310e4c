"""``SlotCache``: expert slots in MLX memory under a byte budget, split over layers by their size.

A layer whose budget holds all its experts is filled once, on first use, with slot = expert id,
and from then on its router indices go to the kernels unchanged. A layer with fewer slots than
experts keeps the most useful ones by its eviction policy (``cache.policy``); a call routing more
experts than it has slots (a speculative pass, a short prefill at a small budget), or any call
when it has none, is served from a staging pool of its own, slots ``0..n-1``, copying what the
layer's slots hold and reading only the rest.

Who writes what, and when: the slot pools are written only by ``fetch`` (and the first fill of a
resident layer), on the model's thread, after the host sync of the call that needs the bytes. A
computation that reads a writable pool is enqueued at once (``ExpertCache``: ``mx.async_eval``),
and writes follow a host sync on work enqueued later on the same in-order stream: a pool never
changes under a pending read. Which expert sits in which slot is a layer's ``Book``: this
process's own (``PolicyBook``), or, for the layers the device-side table serves, the table's
(its miss server keeps them), handed in once by the table before the first call.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Type

import mlx.core as mx
import numpy as np

from ..counters import LayerStats
from ..format.layout import ModelLayout
from ..io.store import ExpertStore
from .policy import EvictionPolicy
from .pool import (
    STAGING_KEEP_BYTES,
    DeviceStaging,
    ExpertPool,
    SlotPool,
    copy_slots,
    read_blobs,
    write_blobs,
)
from .protocol import Book

FILL_CHUNK_BYTES = 64 << 20


def slots_per_layer(layout: ModelLayout, budget_bytes: int) -> Dict[int, int]:
    """The budget split over the MoE layers in proportion to their expert bytes."""
    total = layout.total_expert_bytes
    out = {}
    for i, lay in layout.layers.items():
        share = budget_bytes * lay.layer_bytes / total if total else 0
        out[i] = int(min(lay.num_experts, share // lay.blob_size))
    return out


def smallest_budget(layout: ModelLayout, slots: int) -> int:
    """The fewest bytes whose split (``slots_per_layer``) gives every layer ``slots`` slots (or
    all its experts, where it has fewer).

    Args:
        layout: the model's expert layout.
        slots: the slots wanted in every layer.

    Returns:
        The budget in bytes (0 for a layout without layers).
    """
    total = layout.total_expert_bytes

    def want(i: int) -> int:
        return min(slots, layout.layers[i].num_experts)

    need = 0
    for i, lay in layout.layers.items():
        if lay.layer_bytes:  # the layer's share of the budget must hold want(i) blobs
            need = max(need, -(-want(i) * lay.blob_size * total // lay.layer_bytes))
    # slots_per_layer divides in floating point: step over a rounding that falls short
    while any(n < want(i) for i, n in slots_per_layer(layout, need).items()):
        need += 1
    return need


@dataclass(frozen=True)
class TooSmall:
    """A budget whose slots cannot hold one token's experts in some layer: every call there
    routes more experts than the layer has slots and is served from staging, as with no budget.

    Attributes:
        fewest, most: the fewest and the most slots a layer of the model gets.
        top_k: the experts a token routes.
        at_least: the smallest budget (bytes) that holds one token's experts in every layer.
    """

    fewest: int
    most: int
    top_k: int
    at_least: int

    def describe(self, fmt: Callable[[int], str]) -> str:
        """``3 slots per layer < top-k 8: too small for one token's experts: behaves as 0; at
        least 2.62 MB``, with ``fmt`` writing the bytes.

        Args:
            fmt: bytes -> text.

        Returns:
            The sentence (no line break).
        """
        slots = str(self.fewest) if self.fewest == self.most else f"{self.fewest}-{self.most}"
        plural = "" if slots == "1" else "s"
        return (
            f"{slots} slot{plural} per layer < top-k {self.top_k}: too small for one token's "
            f"experts: behaves as 0 (every call reads its experts); at least "
            f"{fmt(self.at_least)}"
        )


def too_small(layout: ModelLayout, budget_bytes: int, top_k: Optional[int]) -> Optional[TooSmall]:
    """Whether a budget (other than 0) is too small for one token's experts in some layer.

    Args:
        layout: the model's expert layout.
        budget_bytes: the budget, in bytes.
        top_k: the experts a token routes (None or 0: unknown, never too small).

    Returns:
        What falls short, or None where every layer holds ``top_k`` experts (or all of its
        experts), the budget is 0, or ``top_k`` is unknown.
    """
    if budget_bytes <= 0 or not top_k or not layout.layers:
        return None
    slots = slots_per_layer(layout, budget_bytes)
    if all(n >= min(top_k, layout.layers[i].num_experts) for i, n in slots.items()):
        return None
    counts = slots.values()
    return TooSmall(min(counts), max(counts), int(top_k), smallest_budget(layout, int(top_k)))


class PolicyBook:
    """A partly cached layer's bookkeeping kept in this process, by an eviction policy; its
    clock counts the layer's calls."""

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy

    @property
    def slot_of(self) -> np.ndarray:
        return self.policy.slot_of

    def admit(self, experts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        self.policy.clock[0] += 1
        return self.policy.admit(experts, int(self.policy.clock[0]))

    def assigned(self, missing: np.ndarray, victims: np.ndarray) -> None:
        self.policy.assign(missing, victims, int(self.policy.clock[0]))

    def release(self, missing: np.ndarray) -> None:
        """Nothing to undo: the policy assigns slots only once their bytes have landed."""

    def observe(self, rows: np.ndarray) -> None:
        self.policy.observe(rows, int(self.policy.clock[0]) + 1)
        self.policy.clock[0] += len(rows)

    def write(self, pool: SlotPool, slots: np.ndarray, blobs: np.ndarray, stats: LayerStats):
        write_blobs(pool, slots, blobs, stats)

    def settle(self) -> None:
        """Nothing runs beside this process's own writes."""


class SlotCache:
    """Per-layer slot pools under ``budget_bytes``, their books, and the staging pools of calls
    beyond the slots.

    Args:
        store: the expert store.
        layout: the model's expert layout.
        budget_bytes: MLX memory for the slots.
        staging: device slot writes (CUDA); None: host writes.
        policy: the eviction policy class of the layers this process keeps.
    """

    def __init__(
        self,
        store: ExpertStore,
        layout: ModelLayout,
        budget_bytes: int,
        staging: Optional[DeviceStaging],
        policy: Type[EvictionPolicy],
    ):
        self.store, self.staging, self.policy = store, staging, policy
        self.layout, self.budget_bytes = layout, budget_bytes
        self.n_slots = slots_per_layer(layout, budget_bytes)
        self.pools: Dict[int, SlotPool] = {}  # allocated on a layer's first use
        self.books: Dict[int, Book] = {}  # partly cached layers, made on first use
        self.resident: Dict[int, ExpertPool] = {}  # every expert resident, slot == expert id
        # layer -> its book's maker, for layers another owner keeps (the device-side table);
        # set before the first call, never changed after
        self.keepers: Dict[int, Callable[[], Book]] = {}
        self._staging_pools: Dict[str, SlotPool] = {}  # by layout: layers of one shape share
        self._keys: Dict[int, str] = {}

    @property
    def capacity_bytes(self) -> int:
        return sum(n * self.store.layout(i).blob_size for i, n in self.n_slots.items())

    def slot_count(self, layer: int) -> int:
        return self.n_slots[layer]

    def book(self, layer: int) -> Book:
        """The partly cached layer's book, made on first use (before its slots, when a prefill
        teaches it: ``observe``)."""
        book = self.books.get(layer)
        if book is None:
            keeper = self.keepers.get(layer)
            if keeper is not None:
                book = keeper()
            else:
                num = self.store.layout(layer).num_experts
                book = PolicyBook(self.policy(num, self.n_slots[layer]))
            self.books[layer] = book
        return book

    def slot_of(self, layer: int) -> Optional[np.ndarray]:
        """expert -> slot (-1: absent) of a partly cached layer, once it was used."""
        book = self.books.get(layer)
        return None if book is None else book.slot_of

    def pool(self, layer: int) -> SlotPool:
        """The layer's slot pool, allocated on first use."""
        pool = self.pools.get(layer)
        if pool is None:
            pool = self.pools[layer] = SlotPool(
                self.store.layout(layer), self.n_slots[layer], self.staging
            )
            if not self._fills_whole(layer):
                self.book(layer)
        return pool

    def _fills_whole(self, layer: int) -> bool:
        """Whether the layer is read whole at first use and then needs no lookup."""
        return self.n_slots[layer] == self.store.layout(layer).num_experts

    def fetch(
        self, layer: int, experts: np.ndarray, stats: LayerStats
    ) -> Tuple[np.ndarray, ExpertPool]:
        """Make ``experts`` (sorted, unique) resident, after the host sync that named them.

        Returns:
            Their slots and the pool the slots index.

        Raises:
            ExpertReadError: a read failed (the slots it was meant for are free again).
        """
        if len(experts) > self.n_slots[layer]:
            return self._staged(layer, experts, stats)
        pool = self.pool(layer)
        if self._fills_whole(layer):
            self._fill_layer(layer, pool, stats)
            stats.experts_missed += len(experts)
            return experts.astype(np.uint32), pool.pool
        book = self.book(layer)
        missing, victims = book.admit(experts)
        if missing.size:
            try:
                blobs = read_blobs(
                    self.store, layer, missing, stats, pool.read_buffer(missing.size)
                )
                book.write(pool, victims, blobs, stats)
            except BaseException:  # the victims were freed: nothing claims bytes that never came
                book.release(missing)
                raise
            book.assigned(missing, victims)
            stats.experts_missed += missing.size
        return book.slot_of[experts].astype(np.uint32), pool.pool

    def observe(self, layer: int, rows: np.ndarray) -> None:
        """The layer's eviction policy learns from ``rows`` (``[n, top_k]``, calls it did not
        serve, in order): the slots stay as they are. No pool is made here: one would be
        allocated (and waited for) mid-prefill."""
        if layer in self.resident or self._fills_whole(layer) or not len(rows):
            return
        self.book(layer).observe(rows)

    def _staged(
        self, layer: int, experts: np.ndarray, stats: LayerStats
    ) -> Tuple[np.ndarray, ExpertPool]:
        """``experts`` into a staging pool's slots ``0..n-1``: those the layer's slots hold
        copied from them, only the others read."""
        held = np.zeros(len(experts), bool)
        source = self.pools.get(layer)
        slot_of = self.slot_of(layer)
        if source is not None and slot_of is not None:
            # a call still running on the other owner's side could change the slots while they
            # are looked up and copied: let it finish first (later ones run after the copy)
            self.book(layer).settle()
            held = slot_of[experts] >= 0
        pool = self._staging_pool(layer, len(experts))
        slots = np.arange(len(experts))
        missing = experts[~held]
        if missing.size:
            blobs = read_blobs(self.store, layer, missing, stats, pool.read_buffer(missing.size))
            write_blobs(pool, slots[~held], blobs, stats)
        if held.any():
            assert source is not None and slot_of is not None
            t0 = time.perf_counter()
            copy_slots(pool, slots[held], source, slot_of[experts[held]])
            stats.upload_s += time.perf_counter() - t0
        stats.experts_missed += missing.size
        return slots.astype(np.uint32), pool.pool

    def _staging_pool(self, layer: int, n: int) -> SlotPool:
        """Slots for a call of ``n`` experts beyond the layer's slots: one pool per layout, kept
        up to ``STAGING_KEEP_BYTES`` (a layer's reads finish before the next layer writes)."""
        layout = self.store.layout(layer)
        if n * layout.blob_size > STAGING_KEEP_BYTES:
            return SlotPool(layout, n, self.staging)
        key = self._keys.get(layer)
        if key is None:
            key = self._keys[layer] = json.dumps(layout.to_dict(), sort_keys=True)
        pool = self._staging_pools.get(key)
        if pool is None or pool.n_slots < n:
            pool = self._staging_pools[key] = SlotPool(layout, n, self.staging)
        return pool

    def _fill_layer(self, layer: int, pool: SlotPool, stats: LayerStats) -> None:
        """Read the whole layer once, in bounded chunks; afterwards slot == expert id."""
        n = pool.layout.num_experts
        step = max(1, FILL_CHUNK_BYTES // pool.layout.blob_size)
        for e0 in range(0, n, step):
            experts = np.arange(e0, min(e0 + step, n))
            blobs = read_blobs(self.store, layer, experts, stats, pool.read_buffer(len(experts)))
            write_blobs(pool, experts, blobs, stats)
            if pool.device_writes:
                mx.eval(list(pool.raw.values()))  # before the staging buffer is reused
        self.resident[layer] = pool.pool

    def close(self) -> None:
        self.pools.clear()
        self.books.clear()
        self.resident.clear()
        self._staging_pools.clear()
