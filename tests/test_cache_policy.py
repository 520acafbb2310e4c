"""benchmarks/cache_policy.py: the eviction-policy replay is right, and traces come from decode."""

import importlib.util
import random
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "cache_policy.py"
_spec = importlib.util.spec_from_file_location("cache_policy", _PATH)
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)


def test_hand_trace():
    trace = [[1], [2], [3], [1], [2], [3]]
    assert cp.simulate(trace, 2, "lru") == 0  # the cyclic worst case of LRU
    assert cp.simulate(trace, 2, "lfu") == 0
    assert cp.simulate(trace, 2, "opt") == 2  # evicts 2 at t=2 (used later than 1), 1 at t=4
    assert cp.simulate(trace, 3, "lru") == 3  # everything fits: only the first uses miss


def test_optimum_bounds_every_policy_and_sets_stay_resident():
    rng = random.Random(1)
    trace = [
        rng.sample(range(32), 4) if rng.random() < 0.5 else rng.sample(range(8), 4)
        for _ in range(300)
    ]
    routed = sum(len(s) for s in trace)
    for slots in (4, 8, 16):
        hits = {p: cp.simulate(trace, slots, p) for p in cp.POLICIES}
        assert all(0 <= h <= routed for h in hits.values())
        assert hits["opt"] == max(hits.values()), hits
    distinct = len({e for s in trace for e in s})
    assert cp.simulate(trace, distinct, "lru") == routed - distinct
    with pytest.raises(ValueError, match="more than 3 slots"):
        cp.simulate(trace, 3, "lru")
    with pytest.raises(ValueError, match="unknown policy"):
        cp.simulate(trace, 8, "mru")


def test_prefetch_coverage_hand_trace():
    trace = [[1, 2], [3, 4], [1, 2]]
    gate = [[1, 2], [3, 9], [1, 5]]
    c = cp.prefetch_coverage(trace, cp.predictor_sets(trace, gate), n_slots=2)
    assert (c["routed"], c["misses"], c["tokens"]) == (6, 6, 3)  # 2 slots: every use misses
    # t0 reads 1, 2 ahead; t1 reads 3 (routed) and 9 (not); t2 reads 1 (routed) and 5 (not)
    assert c["next-layer gate"] == {"covered": 4, "wasted": 2}
    assert c["previous token"] == {"covered": 0, "wasted": 0}  # still resident, nothing to read
    assert c["both"] == {"covered": 4, "wasted": 2}
    # with no cache to speak of, the previous token's experts are a prediction like any other
    assert cp.predictor_sets([[1, 2], [2, 3]], None)["previous token"] == [set(), {1, 2}]


def test_previous_token_never_covers_an_lru_miss():
    # LRU keeps the last token's experts (the most recently used) whenever a layer holds at
    # least top-k slots, so prefetching them can save no read
    rng = random.Random(2)
    trace = [rng.sample(range(24), 4) for _ in range(200)]
    gate = [rng.sample(range(24), 4) for _ in range(200)]
    for slots in (4, 6, 12):
        c = cp.prefetch_coverage(trace, cp.predictor_sets(trace, gate), slots)
        assert c["previous token"]["covered"] == 0 and c["misses"] > 0
        assert 0 < c["next-layer gate"]["covered"] < c["misses"]


def test_traces_from_decode(tiny_checkpoints):
    src, packed = tiny_checkpoints["qwen3_moe"]
    traces, gate = cp.record_traces(packed, [[1, 2, 3], [4, 5]], tokens=5)
    assert traces and all(len(t) == 10 for t in traces.values())  # 2 prompts x 5 decode tokens
    top_k = {len(s) for t in traces.values() for s in t}
    assert len(top_k) == 1
    k = top_k.pop()
    layers = sorted(traces)
    assert sorted(gate) == layers[1:]  # each layer predicted from the one before it
    for layer in layers[1:]:
        assert len(gate[layer]) == len(traces[layer])
        assert all(len(set(s)) == len(s) == k for s in gate[layer])
        assert all(0 <= e < 16 for s in gate[layer] for e in s)
    pf = cp.run_prefetch(traces, gate, {k: 16 for k in traces}, [0.5])
    assert pf["layers"] == layers[1:]
    assert all(0.0 <= r <= 1.0 for r in pf["recall"].values())
    assert pf["rows"][0]["previous token"]["covered"] == 0.0
    assert "misses covered" in cp.format_prefetch(pf)
    result = cp.run(traces, {k: 16 for k in traces}, [0.25, 0.5], half_lives=[8, 64])
    assert [r["budget"] for r in result["rows"]] == [0.25, 0.5]
    for r in result["rows"]:
        assert r["opt"] >= max(r[c] for c in result["columns"]) - 1e-12
    assert result["columns"] == ["lru", "lfu", "decay 8", "decay 64", "random", "opt"]
    assert "| 25% |" in cp.format_table(result)
