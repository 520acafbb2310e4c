"""Eviction policies: the slot bookkeeping of one partially cached layer (which expert sits in
which slot) and the choice of the slots to free for missing experts. Plain numpy: the miss server
process uses them without MLX.

A policy is a class: ``EvictionPolicy`` keeps the bookkeeping, a subclass says which slots are
used (``touch``) and which to free (``victims``). ``POLICIES`` names them (``LoadOptions
.eviction``): ``lru`` evicts the least recently used; ``lfu`` the least frequently used (use counts
kept across evictions); ``lfuda`` LFU with dynamic aging (an expert's priority is its count plus
the priority of the last one evicted, so old fame fades); ``decay`` the lowest exponentially
decayed use count. Ties go to the least recently used. The device-side table's miss server keeps
LRU (its GPU records last uses only).

With the device-side table, ``slot_of`` is a view into the shared control block
(``cuda.control_block``), read by the GPU, and the LRU's ``device_last`` another, where the GPU
records each slot's last use by calls that needed no help. The GPU's stores to host memory may
land late, so the GPU and the host never write the same words: a slot's last use is the later of
the two.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np


class EvictionPolicy:
    """Which expert is in which slot of one layer, and which slots to free for missing ones.

    Subclasses implement ``touch`` (slots used at ``tick``), ``victims`` (the ``n`` slots to free:
    free slots first) and ``forget`` (slots freed)."""

    name = "?"

    def __init__(self, num_experts: int, n_slots: int, slot_of: Optional[np.ndarray] = None):
        self.slot_of = slot_of if slot_of is not None else np.full(num_experts, -1, np.int64)
        self.expert_in = np.full(n_slots, -1, np.int64)  # slot -> expert (only the host needs it)
        self.clock = np.zeros(1, np.int64)  # one tick per call (the table's is in the block)
        self.now = 0  # the tick of the call being admitted (set by admit)

    def admit(self, experts: np.ndarray, tick: int) -> Tuple[np.ndarray, np.ndarray]:
        """Mark the resident ones used; pick and free a victim slot for each missing one.
        Returns (missing, victims).

        Victims are freed before their new bytes are written: an interrupted write must not
        leave a slot that claims an expert whose bytes never arrived."""
        slots = self.slot_of[experts]
        hit = slots >= 0
        self.now = tick  # the call being admitted: its hits must not be victims
        self.touch(slots[hit], tick)
        missing = experts[~hit]
        if not missing.size:
            return missing, slots[:0]
        victims = self.victims(missing.size)
        old = self.expert_in[victims]
        self.slot_of[old[old >= 0]] = -1
        self.expert_in[victims] = -1
        self.forget(victims)
        return missing, victims

    def assign(self, missing: np.ndarray, victims: np.ndarray, tick: int) -> None:
        """The bytes of ``missing`` are in ``victims`` now."""
        self.slot_of[missing] = victims
        self.expert_in[victims] = missing
        self.touch(victims, tick)

    def release(self, experts: np.ndarray) -> None:
        """Free the slots of ``experts`` (their bytes are not to be trusted)."""
        slots = self.slot_of[experts]
        slots = slots[slots >= 0]
        self.slot_of[experts] = -1
        self.expert_in[slots] = -1
        self.forget(slots)

    def touch(self, slots: np.ndarray, tick: int) -> None:
        raise NotImplementedError

    def victims(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def forget(self, slots: np.ndarray) -> None:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used: free slots first, then the slots whose last use is oldest."""

    name = "lru"

    def __init__(
        self,
        num_experts: int,
        n_slots: int,
        slot_of: Optional[np.ndarray] = None,
        device_last: Optional[np.ndarray] = None,
    ):
        super().__init__(num_experts, n_slots, slot_of)
        self.last_used = np.full(n_slots, -1, np.int64)  # slot -> clock of its last use, -1: free
        self.device_last = device_last

    def touch(self, slots: np.ndarray, tick: int) -> None:
        self.last_used[slots] = tick

    def victims(self, n: int) -> np.ndarray:
        last = self.last_used
        if self.device_last is not None:
            last = np.maximum(last, self.device_last)
            last[self.last_used < 0] = -1  # freed by the host since: free whatever the GPU saw
        return np.argpartition(last, n - 1)[:n]

    def forget(self, slots: np.ndarray) -> None:
        self.last_used[slots] = -1


class _CountingPolicy(LRUPolicy):
    """LRU's bookkeeping plus a score per expert; the victims are the lowest scores (free slots
    first, ties by last use)."""

    def __init__(
        self,
        num_experts: int,
        n_slots: int,
        slot_of: Optional[np.ndarray] = None,
        device_last: Optional[np.ndarray] = None,
    ):
        super().__init__(num_experts, n_slots, slot_of, device_last)
        self.count = np.zeros(num_experts, np.float64)  # uses per expert, kept across evictions
        self.setup(num_experts)

    def setup(self, num_experts: int) -> None:
        """A subclass's own per-expert state."""

    def score(self, experts: np.ndarray, tick: int) -> np.ndarray:
        raise NotImplementedError

    def touch(self, slots: np.ndarray, tick: int) -> None:
        super().touch(slots, tick)
        experts = self.expert_in[slots]
        self.count[experts[experts >= 0]] += 1

    def victims(self, n: int) -> np.ndarray:
        used = self.expert_in >= 0
        score = np.full(self.expert_in.size, -np.inf)  # free slots first
        score[used] = self.score(self.expert_in[used], self.now)
        score[self.last_used == self.now] = np.inf  # this call's hits stay (admit touched them)
        order = np.lexsort((self.last_used, score))  # by score, then oldest use
        return order[:n]


class LFUPolicy(_CountingPolicy):
    """Least frequently used: the fewest uses so far (ties: least recently used)."""

    name = "lfu"

    def score(self, experts: np.ndarray, tick: int) -> np.ndarray:
        return self.count[experts]


class LFUDAPolicy(_CountingPolicy):
    """LFU with dynamic aging: priority = uses + the cache's age, where the age is the priority
    of the last expert evicted; an expert used often long ago ages out."""

    name = "lfuda"

    def setup(self, num_experts: int) -> None:
        self.age = 0.0
        self.priority = np.zeros(num_experts, np.float64)

    def touch(self, slots: np.ndarray, tick: int) -> None:
        super().touch(slots, tick)
        experts = self.expert_in[slots]
        experts = experts[experts >= 0]
        self.priority[experts] = self.count[experts] + self.age

    def score(self, experts: np.ndarray, tick: int) -> np.ndarray:
        return self.priority[experts]

    def victims(self, n: int) -> np.ndarray:
        out = super().victims(n)
        evicted = self.expert_in[out]
        evicted = evicted[evicted >= 0]
        if evicted.size:
            self.age = float(self.priority[evicted].max())
        return out


class DecayPolicy(_CountingPolicy):
    """The lowest use count decayed exponentially with a half-life of ``half_life`` calls."""

    name = "decay"
    half_life = 8.0  # calls; the best of 8/32/128 on random-weight traces (docs/benchmarks.md)

    def setup(self, num_experts: int) -> None:
        self.at = np.zeros(num_experts, np.int64)  # the call each count was last brought up to

    def touch(self, slots: np.ndarray, tick: int) -> None:
        experts = self.expert_in[slots]
        experts = experts[experts >= 0]
        self.count[experts] *= 0.5 ** ((tick - self.at[experts]) / self.half_life)
        self.at[experts] = tick
        super().touch(slots, tick)

    def score(self, experts: np.ndarray, tick: int) -> np.ndarray:
        return self.count[experts] * 0.5 ** ((tick - self.at[experts]) / self.half_life)


POLICIES = {p.name: p for p in (LRUPolicy, LFUPolicy, LFUDAPolicy, DecayPolicy)}
