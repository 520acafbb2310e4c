"""Slot bookkeeping of one partially cached layer: which expert sits in which slot, and LRU
eviction. Plain numpy (the miss server process uses it without MLX).

With the device-side table, ``slot_of`` is a view into the shared control block
(``control_block.py``), read by the GPU, and ``device_last`` another, where the GPU records each
slot's last use by calls that needed no help. The GPU's stores to host memory may land late, so
the GPU and the host never write the same words: a slot's last use is the later of the two."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np


class SlotLRU:
    def __init__(self, num_experts: int, n_slots: int, slot_of: Optional[np.ndarray] = None,
                 device_last: Optional[np.ndarray] = None):
        self.slot_of = slot_of if slot_of is not None else np.full(num_experts, -1, np.int64)
        self.last_used = np.full(n_slots, -1, np.int64)  # slot -> clock of its last use, -1: free
        self.device_last = device_last
        self.expert_in = np.full(n_slots, -1, np.int64)  # slot -> expert (only the host needs it)
        self.clock = np.zeros(1, np.int64)  # one tick per call (the table's is in the block)

    def admit(self, experts: np.ndarray, tick: int) -> Tuple[np.ndarray, np.ndarray]:
        """Mark the resident ones used; pick and free a victim slot for each missing one (free
        slots first, then the least recently used not needed now). Returns (missing, victims).

        Victims are freed before their new bytes are written: an interrupted write must not
        leave a slot that claims an expert whose bytes never arrived."""
        slots = self.slot_of[experts]
        hit = slots >= 0
        self.last_used[slots[hit]] = tick
        missing = experts[~hit]
        if not missing.size:
            return missing, slots[:0]
        last = self.last_used
        if self.device_last is not None:
            last = np.maximum(last, self.device_last)
            last[self.last_used < 0] = -1  # freed by the host since: free whatever the GPU saw
        victims = np.argpartition(last, missing.size - 1)[:missing.size]
        old = self.expert_in[victims]
        self.slot_of[old[old >= 0]] = -1
        self.expert_in[victims] = -1
        self.last_used[victims] = -1
        return missing, victims

    def assign(self, missing: np.ndarray, victims: np.ndarray, tick: int) -> None:
        self.slot_of[missing] = victims
        self.expert_in[victims] = missing
        self.last_used[victims] = tick

    def release(self, experts: np.ndarray) -> None:
        slots = self.slot_of[experts]
        slots = slots[slots >= 0]
        self.slot_of[experts] = -1
        self.expert_in[slots] = -1
        self.last_used[slots] = -1
