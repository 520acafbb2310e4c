"""benchmarks/cache_policy.py and its library (benchmarks/lib/routing.py): the replay drives
the package's own eviction policies and counts exactly, the reuse figures are right on hand
traces, traces survive a round trip through their files, and recording works
on a model moeflux_mlx.load opens."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.lib import routing as R
from moeflux_mlx.cache.policy import POLICIES, LRUPolicy, TransitionPolicy

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "cache_policy.py"
_spec = importlib.util.spec_from_file_location("cache_policy", _PATH)
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)


def _misses(trace, slots, name, experts=8):
    return R.misses(np.array(trace), experts, slots, R.policy_factories()[name])


def test_hand_trace_belady_below_lru():
    trace = [[1], [2], [3], [1], [2], [3]]
    assert _misses(trace, 2, "lru") == 6  # the cyclic worst case of LRU: every use misses
    assert _misses(trace, 2, "transition") >= _misses(trace, 2, "opt")
    assert _misses(trace, 2, "opt") == 4  # evicts 2 at t=2 (used later than 1), 1 at t=4
    assert _misses(trace, 3, "lru") == _misses(trace, 3, "opt") == 3  # only the first uses
    # two experts a token (a repeat counts once): at t=3 LRU evicts 1, the one used next;
    # Belady evicts 0 or 2, never used again
    pairs = [[0, 1], [2, 0], [3, 3], [1, 1]]
    assert _misses(pairs, 3, "lru") == 5 and _misses(pairs, 3, "opt") == 4


def test_the_replay_runs_the_package_policies():
    factories = R.policy_factories()
    assert (
        set(factories)
        == set(POLICIES) | {"random", "opt"}
        == {"transition", "lru", "random", "opt"}
    )
    t = np.array([[0]])
    assert type(factories["lru"](8, 2, t)) is LRUPolicy
    assert type(factories["transition"](8, 2, t)) is TransitionPolicy
    # the replay's LRU and the cache's own bookkeeping agree call by call
    rng = np.random.default_rng(3)
    trace = np.array([rng.choice(16, 4, replace=False) for _ in range(100)])
    p = LRUPolicy(16, 6)
    want = []
    for tick, row in enumerate(trace, start=1):
        missing, victims = p.admit(np.unique(row), tick)
        p.assign(missing, victims, tick)
        want.append(missing.size)
    got = [m.size for _, m, _ in R.replay(trace, 16, 6, LRUPolicy(16, 6))]
    assert got == want


def test_optimum_bounds_every_policy():
    rng = np.random.default_rng(1)
    trace = np.array(
        [rng.choice(32 if rng.random() < 0.5 else 8, 4, replace=False) for _ in range(300)]
    )
    for slots in (4, 8, 16):
        got = {n: R.misses(trace, 32, slots, f) for n, f in R.policy_factories().items()}
        assert got["opt"] == min(got.values()), got
    with pytest.raises(ValueError, match="more than 3 slots"):
        R.misses(trace, 32, 3, R.policy_factories()["lru"])


def test_replay_table_counts_misses_per_token():
    # [4 tokens, 2 layers, k=1]
    trace = R.RoutingTrace(
        routed=np.array([[[1], [1]], [[2], [1]], [[3], [1]], [[1], [1]]]),
        layers=[0, 1],
        num_experts=[8, 8],
        tokens=np.arange(4),
    )
    table = R.replay_table(trace, budgets=[0.25])
    row = table["rows"][0]
    assert row["slots"] == [2, 2]
    # layer 0: 1 2 3 1 with 2 slots: LRU misses all 4, Belady 3; layer 1: one miss
    assert row["lru"] == (4 + 1) / 4 and row["opt"] == (3 + 1) / 4
    assert table["columns"] == list(R.policy_factories())


def test_page_cache_serves_repeats_within_its_size():
    # one layer of 8 experts, k=1, 2 slots (25%): a cycle over 4 experts misses every time
    cycle = np.array([[[e]] for e in [0, 1, 2, 3] * 5])
    trace = R.RoutingTrace(routed=cycle, layers=[0], num_experts=[8], tokens=np.arange(20))
    table = R.page_cache_table(trace, budget=0.25, fractions=(0.25, 0.5, 1.0))
    served = {r["fraction"]: r["served"] for r in table["rows"]}
    assert table["misses_per_token"] == 1.0
    # 2 experts of page cache, LRU: the cycle of 4 pushes each out before it comes back
    assert served[0.25] == 0.0
    # room for the 4: every miss after the first four is served
    assert served[0.5] == served[1.0] == 16 / 20
    # misses summed over layers in token order, one page cache for both layers
    two = R.RoutingTrace(
        routed=np.concatenate([cycle, cycle], axis=1),
        layers=[0, 1],
        num_experts=[8, 8],
        tokens=np.arange(20),
    )
    got = {r["fraction"]: r["served"] for r in R.page_cache_table(two, 0.25, (0.25, 0.5))["rows"]}
    # 25% of 16 is one layer's cycle, not both: shared, it serves none; 50% holds both
    assert got == {0.25: 0.0, 0.5: 16 / 20}


def test_window_scores_hand_trace():
    routed = np.array([[0, 1], [1, 2], [2, 3], [0, 1]])
    hot = R.one_hot(routed, 4)
    w1 = R.window_scores(routed, 4, 1)
    assert np.isinf(w1[0]).all()  # nothing before the first token
    named = np.isfinite(w1)
    assert named[1:].tolist() == hot[:-1].tolist()  # window 1: the previous token's experts
    # token 1 reuses 1 of {1, 2}, token 2 reuses 2 of {2, 3}, token 3 reuses none of {0, 1}
    assert (named[1:] & hot[1:]).sum() == 2
    w2 = np.isfinite(R.window_scores(routed, 4, 2))
    assert w2[3].tolist() == [False, True, True, True]  # tokens 1 and 2
    # ranked by uses in the window, ties by recency: over tokens 0-2, 1 and 2 were used twice
    # (2 last), 0 and 3 once (3 last)
    w3 = R.window_scores(routed, 4, 3)[3]
    assert np.argsort(-w3).tolist() == [2, 1, 3, 0]


def test_reuse_table_hand_trace():
    trace = R.RoutingTrace(
        routed=np.array([[0, 1], [1, 2], [2, 3], [0, 1], [0, 1]])[:, None, :],
        layers=[0],
        num_experts=[4],
        tokens=np.arange(5),
    )
    rows = {r["window"]: r for r in R.reuse_table(trace, [1, 2])}
    # from token 2 on: reuse within 1 token 1/2, 0/2, 2/2; within 2 tokens 1/2, 1/2, 2/2
    assert rows[1]["reuse"] == pytest.approx(3 / 6) and rows[2]["reuse"] == pytest.approx(4 / 6)
    assert rows[1]["distinct"] == 2 and rows[2]["distinct"] == pytest.approx((3 + 3 + 4) / 3)


def test_skew():
    uniform = R.skew(np.full(20, 5))
    assert uniform == pytest.approx({"top10": 0.1, "entropy": 1.0, "gini": 0.0, "unused": 0})
    one = R.skew(np.array([0, 0, 0, 9]))
    assert one["top10"] == 1.0 and one["entropy"] == 0.0 and one["gini"] == pytest.approx(0.75)
    assert one["unused"] == 3


def _trace(tokens=50, layers=3, experts=64, k=8, seed=0):
    rng = np.random.default_rng(seed)
    routed = np.stack(
        [[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(tokens)]
    )
    return R.RoutingTrace(
        routed=routed,
        layers=list(range(layers)),
        num_experts=[experts] * layers,
        tokens=np.arange(tokens),
        meta={"model": "m", "mode": "teacher-forced"},
    )


def test_trace_file_round_trip(tmp_path):
    trace = _trace()
    path = trace.save(tmp_path / "t")
    assert path.suffix == ".npz" and path.exists()
    with np.load(path) as z:
        assert z["routed"].dtype == np.uint8
        saved = dict(z)
    back = R.RoutingTrace.load(path)
    assert (back.routed == trace.routed).all() and back.layers == trace.layers
    assert back.num_experts == trace.num_experts
    assert (back.tokens == trace.tokens).all() and back.meta["model"] == "m"
    assert not back.predicted and back.pred_layers == [] and back.eval_from == 0
    # a trace recorded with next-layer predictions (when the package prefetched) keeps them
    older = {**saved, "pred_layers": np.array([1, 2]), "eval_from": np.array(30)}
    older["pred_gate"] = np.arange(20 * 2 * 16).reshape(20, 2, 16).astype(np.uint8)
    np.savez(tmp_path / "older.npz", **older)
    old = R.RoutingTrace.load(tmp_path / "older.npz")
    assert (old.routed == trace.routed).all() and old.pred_layers == [1, 2] and old.eval_from == 30
    assert (old.predicted["gate"] == older["pred_gate"]).all()
    assert (
        R.RoutingTrace.load(old.save(tmp_path / "again")).predicted["gate"] == old.predicted["gate"]
    ).all()
    big = _trace(experts=300, layers=2)
    big.save(tmp_path / "big.npz")
    assert (R.RoutingTrace.load(tmp_path / "big.npz").routed == big.routed).all()
    np.savez(tmp_path / "other.npz", x=np.zeros(2))
    with pytest.raises(ValueError, match="not a routing trace"):
        R.RoutingTrace.load(tmp_path / "other.npz")
    # the routing saved by the earlier version of the benchmark (JSON)
    old = {
        "model": "m",
        "num_experts": {"0": 8, "2": 8},
        "traces": {"0": [[1, 2], [3, 4]], "2": [[5, 6], [1, 2]]},
        "gate_predicted": {"2": [[5, 7], [1, 0]]},
    }
    (tmp_path / "old.json").write_text(json.dumps(old))
    back = R.RoutingTrace.load(tmp_path / "old.json")
    assert back.routed.shape == (2, 2, 2) and back.layers == [0, 2] and back.pred_layers == [2]
    assert back.predicted["gate"].tolist() == [[[5, 7]], [[1, 0]]]


def test_report_from_saved_traces(tmp_path):
    path = _trace().save(tmp_path / "t.npz")
    assert cp.main(["--traces", str(path), "--out", str(tmp_path), "--label", "x"]) == 0
    (md,) = tmp_path.glob("*-x-routing.md")
    text = md.read_text()
    for heading in ("Expert popularity", "Reuse", "Eviction", "page cache"):
        assert heading in text
    assert "Predictors" not in text
    assert "| transition | lru |" in text and "| opt |" in text and "| 10% |" in text


def test_recording_on_a_model(tiny_checkpoints, tmp_path):
    _, packed = tiny_checkpoints["qwen3_moe"]
    tokens = np.random.default_rng(0).integers(0, 500, 40)
    text, dec = R.record_text(packed, tokens, context=16, decode=5, prompt_tokens=8)
    assert text.routed.shape == (40, 2, 4) and text.layers == [0, 1]
    assert all(len(set(row)) == 4 for row in text.routed.reshape(-1, 4))  # top-4, distinct
    assert (text.tokens == tokens).all() and text.meta["mode"] == "teacher-forced"
    assert dec.routed.shape == (5, 2, 4) and dec.meta["mode"] == "greedy decode"
    # routing of the same token in the same context is the same, decoded or teacher-forced
    again, _ = R.record_text(packed, np.concatenate([tokens[:8], dec.tokens]), context=16)
    assert (np.sort(again.routed[8:], -1) == np.sort(dec.routed, -1)).all()
    with pytest.raises(ValueError, match="vocabulary"):
        R.record_text(packed, np.array([0, 1, 10**6]))
    back = R.RoutingTrace.load(text.save(tmp_path / "t"))
    assert (back.routed == text.routed).all()


def test_text_sample_whole_or_per_document(tmp_path):
    ids = np.arange(100, dtype=np.uint16)
    np.save(tmp_path / "t.npy", ids)
    docs = {"documents": {"start": [0, 10, 60], "tokens": [10, 50, 40]}}
    (tmp_path / "t.json").write_text(json.dumps(docs))
    tokens, what = cp.text_tokens(tmp_path / "t.npy", 5, 20, 0)
    assert tokens.tolist() == list(range(5, 25)) and what == "t.npy[5:25]"
    tokens, what = cp.text_tokens(tmp_path / "t.npy", 0, 35, 20)
    assert tokens.tolist() == list(range(0, 10)) + list(range(10, 30)) + list(range(60, 65))
    assert what == "t.npy: the first 20 tokens of documents 0-2"


def test_prompt_learning_replays_windows_with_and_without_the_prompt():
    """Each window: LRU's misses and each policy's share of them, fresh and taught the prompt
    (LRU learns nothing from it); the report has a row per window and the summed ratios."""
    trace = _trace(tokens=60, layers=2)
    out = R.prompt_learning_table(
        trace, policies=("lru", "transition"), prompt_tokens=5, decode_tokens=10, step=15
    )
    assert [r["start"] for r in out["rows"]] == [0, 15, 30, 45]
    for r in out["rows"]:
        want = sum(
            sum(
                m.size
                for _, m, _ in R.replay(
                    trace.routed[r["start"] + 5 : r["start"] + 15, i], 64, 16, LRUPolicy(64, 16)
                )
            )
            for i in range(2)
        )
        assert r["LRU"] == want > 0 and r["lru"] == r["lru learnt"] == 1.0
        assert 0 < r["transition learnt"] <= 1.5
    assert any(r["transition learnt"] != r["transition"] for r in out["rows"])
    pooled = out["pooled"]
    assert set(pooled) == {"lru", "lru learnt", "transition", "transition learnt"}
    text = R.format_prompt_learning(out)
    assert "| 45 |" in text and "| all, summed |" in text
