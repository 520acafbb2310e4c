"""Predictors of the next MoE layer's experts (model.predict): the ridge map fitted to a model's
routing recovers a linear mapping, and router scores are what the routers compute."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from moeflux_mlx.model.predict import RidgeRouterMap, router_scores, top_experts


def _linear_problem(rows=600, inputs=32, experts=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, inputs)) * 3.0 + 1.0  # scale and offset: alpha is relative
    w = rng.normal(size=(inputs, experts))
    b = rng.normal(size=experts)
    return x, x @ w + b


def test_ridge_recovers_a_linear_mapping():
    x, y = _linear_problem()
    fit, test = slice(0, 400), slice(400, None)
    rmap = RidgeRouterMap(x.shape[1], y.shape[1], alpha=1e-6)
    rmap.add(x[fit], y[fit])
    rmap.solve()
    assert np.allclose(rmap.scores(x[test]), y[test], atol=1e-3)
    k = 4
    want, got = top_experts(y[test], k), rmap.predict(x[test], k)
    recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(want, got)])
    assert recall == 1.0
    assert (got == want).all()  # the same order too


def test_ridge_batches_add_up_and_misuse_is_refused():
    x, y = _linear_problem(rows=300)
    whole = RidgeRouterMap(x.shape[1], y.shape[1])
    whole.add(x, y)
    whole.solve()
    parts = RidgeRouterMap(x.shape[1], y.shape[1])
    for i in range(0, 300, 64):  # e.g. one forward pass at a time, as [1, T, H] arrays
        parts.add(x[None, i : i + 64], y[None, i : i + 64])
    parts.solve()
    assert parts.rows == 300 and np.allclose(parts.weight, whole.weight)
    fresh = RidgeRouterMap(x.shape[1], y.shape[1])
    with pytest.raises(ValueError, match="not fitted"):
        fresh.predict(x, 2)
    with pytest.raises(ValueError, match="no rows"):
        fresh.solve()
    with pytest.raises(ValueError, match="do not match"):
        fresh.add(x[:10], y[:9])
    with pytest.raises(ValueError, match="scores"):
        fresh.add(x, y[:, :3])


def test_ridge_shrinks_towards_zero_with_alpha():
    x, y = _linear_problem(rows=200)
    norms = []
    for alpha in (1e-6, 1.0, 100.0):
        rmap = RidgeRouterMap(x.shape[1], y.shape[1], alpha)
        rmap.add(x, y)
        rmap.solve()
        norms.append(np.linalg.norm(rmap.weight[:-1]))  # the bias row is not shrunk
    assert norms[0] > norms[1] > norms[2]


def test_top_experts_best_first():
    scores = np.array([[0.1, 0.9, 0.5, 0.7], [3.0, -1.0, 2.0, 0.0]])
    assert top_experts(scores, 3).tolist() == [[1, 3, 2], [0, 2, 3]]


def test_router_scores_of_a_linear_and_of_a_gate_module():
    x = mx.random.normal((3, 8))
    lin = nn.Linear(8, 5, bias=False)
    assert mx.allclose(router_scores(lin, x), x @ lin.weight.T).item()

    class Gate(nn.Module):  # DeepSeek's MoEGate: a 2-D weight, and a call returning its choice
        def __init__(self):
            super().__init__()
            self.weight = mx.random.normal((5, 8))

        def __call__(self, x):
            return mx.argpartition(-(x @ self.weight.T), 1, axis=-1)[..., :2], None

    gate = Gate()
    assert mx.allclose(router_scores(gate, x), x @ gate.weight.T).item()
