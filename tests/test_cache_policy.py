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
    trace = [rng.sample(range(32), 4) if rng.random() < 0.5 else rng.sample(range(8), 4)
             for _ in range(300)]
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


def test_traces_from_decode(tiny_checkpoints):
    src, packed = tiny_checkpoints["qwen3_moe"]
    traces = cp.record_traces(packed, [[1, 2, 3], [4, 5]], tokens=5)
    assert traces and all(len(t) == 10 for t in traces.values())  # 2 prompts x 5 decode tokens
    top_k = {len(s) for t in traces.values() for s in t}
    assert len(top_k) == 1
    result = cp.run(traces, {k: 16 for k in traces}, [0.25, 0.5], half_lives=[8, 64])
    assert [r["budget"] for r in result["rows"]] == [0.25, 0.5]
    for r in result["rows"]:
        assert r["opt"] >= max(r[c] for c in result["columns"]) - 1e-12
    assert result["columns"] == ["lru", "lfu", "decay 8", "decay 64", "random", "opt"]
    assert "| 25% |" in cp.format_table(result)
