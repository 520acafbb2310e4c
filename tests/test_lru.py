"""Slot bookkeeping (moeflux_mlx.cache.policy): LRU eviction, and the device-side table's split of a
slot's last use between the host and the GPU."""

import numpy as np

from moeflux_mlx.cache.policy import LRUPolicy as SlotLRU


def _admit(lru, experts, tick):
    missing, victims = lru.admit(np.array(experts), tick)
    lru.assign(missing, victims, tick)
    return missing.tolist(), victims.tolist()


def test_lru_evicts_the_least_recently_used_not_needed_now():
    lru = SlotLRU(10, 3)
    assert _admit(lru, [1, 2, 3], 1)[0] == [1, 2, 3]
    _admit(lru, [1], 2)
    _admit(lru, [3], 3)
    missing, victims = _admit(lru, [3, 4], 4)  # 2 is the oldest; 3 is needed now
    assert missing == [4] and victims == [lru.slot_of[4]] and lru.slot_of[2] == -1
    lru.release(np.array([1]))
    missing, victims = _admit(lru, [5], 5)  # a released slot is taken first
    assert lru.slot_of[1] == -1 and lru.slot_of[3] >= 0 and lru.slot_of[4] >= 0


def test_device_uses_count_and_late_device_stores_cannot_evict_what_a_call_needs():
    device_last = np.full(3, -1, np.int64)
    lru = SlotLRU(10, 3, device_last=device_last)
    _admit(lru, [1, 2, 3], 1)
    # the GPU used expert 1 at tick 5 without asking the host: 1 is not the oldest any more
    device_last[lru.slot_of[1]] = 5
    missing, _ = _admit(lru, [7], 6)
    assert missing == [7] and lru.slot_of[1] >= 0 and lru.slot_of[2] == -1
    # a late GPU store of an old tick onto a slot the host just marked cannot make it a victim
    s3 = lru.slot_of[3]
    device_last[s3] = 0
    missing, victims = _admit(lru, [3, 8], 7)
    assert missing == [8] and s3 not in victims and lru.slot_of[3] == s3
    # a slot the host freed is free, whatever the GPU last stored there
    s7 = lru.slot_of[7]
    device_last[s7] = 8  # the GPU's last use, after which the host freed the slot
    lru.release(np.array([7]))
    _, victims = _admit(lru, [9], 9)
    assert victims == [s7]
