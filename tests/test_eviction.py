"""Eviction policies (cache.policy): each keeps output exact, and each evicts what it says."""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import moeflux_mlx
from moeflux_mlx.cache.policy import POLICIES, DecayPolicy, LFUDAPolicy, LFUPolicy, LRUPolicy
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.options import EVICTIONS, LoadOptions


def _run(policy_class, trace, n_slots, num_experts=8):
    """Replay ``trace`` (one list of experts per call) through ``policy_class``; returns the
    policy and the misses per call."""
    p = policy_class(num_experts, n_slots)
    misses = []
    for tick, experts in enumerate(trace, start=1):
        missing, victims = p.admit(np.array(sorted(experts)), tick)
        p.assign(missing, victims, tick)
        misses.append(missing.tolist())
        resident = set(np.flatnonzero(p.slot_of >= 0).tolist())
        assert set(experts) <= resident and len(resident) <= n_slots
        assert sorted(p.slot_of[p.slot_of >= 0].tolist()) == sorted(set(p.slot_of[p.slot_of >= 0]))
    return p, misses


def test_the_option_names_every_policy():
    assert set(EVICTIONS) == set(POLICIES)
    assert LoadOptions().eviction == "lru"


def test_lru_and_lfu_differ_where_frequency_counts():
    # expert 0 is used often early; then 1, 2, 3 arrive: LRU evicts 0, LFU keeps it
    trace = [[0], [0], [0], [1], [2], [3]]
    _, lru = _run(LRUPolicy, trace, n_slots=2)
    p, lfu = _run(LFUPolicy, trace, n_slots=2)
    assert lru[-1] == [3] and lfu[-1] == [3]
    assert p.slot_of[0] >= 0  # LFU kept the frequent one
    assert _run(LRUPolicy, trace, 2)[0].slot_of[0] < 0  # LRU did not


def test_lfuda_lets_old_fame_fade():
    # 0 is famous early, then never used; LFU keeps it forever, LFUDA ages it out
    trace = [[0]] * 5 + [[1], [2]] * 4
    lfu, _ = _run(LFUPolicy, trace, n_slots=2)
    lfuda, _ = _run(LFUDAPolicy, trace, n_slots=2)
    assert lfu.slot_of[0] >= 0 and lfuda.slot_of[0] < 0


def test_decay_forgets_with_its_half_life():
    trace = [[0]] * 4 + [[1]] + [[2]] * 40 + [[3]]
    p, _ = _run(DecayPolicy, trace, n_slots=2)
    # by the end 0's count has decayed far below 2's: 3 replaced 0 and 2 stayed
    assert p.slot_of[0] < 0 and p.slot_of[2] >= 0 and p.slot_of[3] >= 0


@pytest.mark.parametrize("eviction", sorted(POLICIES))
def test_every_policy_keeps_decode_exact(tiny_checkpoints, eviction):
    src, packed = tiny_checkpoints["qwen3_moe"]
    stock, tokenizer = mlx_lm.load(str(src))
    prompt = mx.array(tokenizer.encode("one two three four five six seven eight"))

    def greedy(model, n=16):
        return [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))]

    want = greedy(stock)
    total = expert_layout(packed).total_expert_bytes
    model, _ = moeflux_mlx.load(packed, cache_budget=int(0.3 * total), eviction=eviction)
    with model.moeflux as rt:
        assert rt.cache.policy_class is POLICIES[eviction]
        assert greedy(model) == want
        assert 0 < rt.stats.hit_rate < 1


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_call_never_evicts_its_own_hits(policy):
    # 0 is frequent and old; 5 was just admitted (count 1); a call needing 5 and a new expert
    # must evict 0, never 5, whatever the policy's score says about 5
    trace = [[0]] * 6 + [[5]] + [[5, 6]]
    p, misses = _run(POLICIES[policy], trace, n_slots=2)
    assert misses[-1] == [6] and p.slot_of[5] >= 0 and p.slot_of[6] >= 0
