"""Which experts the next MoE layer will route to, predicted from this layer's MoE input.

The prediction for the next MoE layer is its own router applied to this layer's input (the
offloading literature reports high recall for this on trained models). It is built lazily, next
to this layer's router indices, so evaluating both costs one host sync; the caches hand it to
their read-ahead (``io.prefetch`` on the synced path, the miss server on the device-side table).

Routers are found as the experts are (``model.experts.find_router``): the linear map onto the
next layer's experts in its decoder layer, whatever the architecture calls it. A router that
reads another size than this layer's experts do (e.g. nemotron_h's latent experts) predicts
nothing.

``RidgeRouterMap`` is the other predictor: a linear map from this layer's MoE input to the next
layer's router scores, fitted to the model's own routing by ridge regression (closed form,
numpy). It can be fitted on a prompt's prefill and then predict the decode tokens; it is measured
in ``benchmarks/cache_policy.py`` (docs/routing.md) and not yet wired into prefetch.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..format.layout import ModelLayout
from .experts import expert_projections, find_router, router_input_dims


def predict_experts(gate: nn.Module, x: mx.array, k: int) -> mx.array:
    """Top-``k`` experts the router ``gate`` would pick for ``x`` (lazy)."""
    out = gate(x)
    if isinstance(out, tuple):  # DeepSeek's MoEGate returns (indices, scores)
        return out[0]
    return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]


def router_scores(router: nn.Module, x: mx.array) -> mx.array:
    """Every expert's score (the router's logits) for ``x``: what its top-k is taken from.

    Args:
        router: a router ``find_router`` found: a linear layer (plain or quantized), or a module
            holding a 2-D ``weight`` [experts, inputs] whose call returns its own choice
            (DeepSeek's ``MoEGate``: its logits are ``x @ weight.T``, before any bias or group
            selection).
        x: the router's input, ``[..., inputs]``.

    Returns:
        ``[..., experts]`` scores (lazy).
    """
    if isinstance(router, (nn.Linear, nn.QuantizedLinear)):
        return router(x)
    return x @ router["weight"].T


def top_experts(scores: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` highest-scoring experts of each row, best first.

    Args:
        scores: ``[n, experts]``.
        k: how many (at most the number of experts).

    Returns:
        ``[n, k]`` expert indices (int64).
    """
    part = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, part, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1)


class RidgeRouterMap:
    """A linear map from one MoE layer's input to another layer's router scores, fitted by
    ridge regression: ``W = (X'X + lambda I)^-1 X'Y`` with a bias column (not penalized), where
    ``lambda = alpha * trace(X'X) / inputs`` so that ``alpha`` does not depend on the scale of
    the hidden state. Rows may come in batches (``add``), e.g. one forward pass at a time; only
    the two sums are kept (``inputs^2 + inputs * outputs`` numbers), never the rows.

    Args:
        inputs: the hidden size it reads.
        outputs: the number of experts it scores.
        alpha: the ridge strength, relative to the mean of ``X'X``'s diagonal.
    """

    def __init__(self, inputs: int, outputs: int, alpha: float = 1e-3):
        self.alpha = alpha
        self.xtx = np.zeros((inputs + 1, inputs + 1))  # float64: sums of many rows
        self.xty = np.zeros((inputs + 1, outputs))
        self.rows = 0
        self.weight: Optional[np.ndarray] = None  # [inputs + 1, outputs] once solved

    @staticmethod
    def _with_bias(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        return np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """Take rows into the fit (before ``solve``; later rows need another ``solve``).

        Args:
            x: ``[..., inputs]`` hidden states.
            y: ``[..., outputs]`` the scores wanted for them.

        Raises:
            ValueError: ``x`` and ``y`` differ in rows, or their widths are not the map's.
        """
        xb = self._with_bias(x)
        y = np.asarray(y, np.float64).reshape(-1, y.shape[-1])
        if xb.shape[0] != y.shape[0] or xb.shape[1] != self.xtx.shape[0]:
            raise ValueError(f"rows or widths do not match: x {x.shape}, y {y.shape}")
        if y.shape[1] != self.xty.shape[1]:
            raise ValueError(f"y has {y.shape[1]} scores, the map {self.xty.shape[1]}")
        self.xtx += xb.T @ xb
        self.xty += xb.T @ y
        self.rows += xb.shape[0]

    def solve(self) -> None:
        """Fit the map to the rows added so far.

        Raises:
            ValueError: no rows were added.
        """
        if not self.rows:
            raise ValueError("no rows to fit")
        d = self.xtx.shape[0] - 1
        lam = self.alpha * max(float(np.trace(self.xtx[:d, :d])) / max(d, 1), 1e-12)
        reg = np.eye(d + 1) * lam
        reg[d, d] = 0.0  # the bias is not shrunk
        self.weight = np.linalg.solve(self.xtx + reg, self.xty)

    def scores(self, x: np.ndarray) -> np.ndarray:
        """The predicted scores of ``x``.

        Args:
            x: ``[..., inputs]``.

        Returns:
            ``[rows, outputs]`` (float64).

        Raises:
            ValueError: the map was not solved.
        """
        if self.weight is None:
            raise ValueError("the map is not fitted: call solve() first")
        return self._with_bias(x) @ self.weight

    def predict(self, x: np.ndarray, k: int) -> np.ndarray:
        """The ``k`` experts with the highest predicted scores for each row of ``x``, best first.

        Args:
            x: ``[..., inputs]``.
            k: how many experts.

        Returns:
            ``[rows, k]`` expert indices.

        Raises:
            ValueError: the map was not solved.
        """
        return top_experts(self.scores(x), k)


def _dims(module: Optional[nn.Module], layout: Optional[ModelLayout], layer: int):
    """(experts, input size) of the experts module at a layer: from the module where it is
    still mlx-lm's, else from the expert layout (a streaming module holds no weights)."""
    projections = expert_projections(module) if module is not None else None
    if projections is not None:
        first = getattr(module, projections[0])
        return int(first.num_experts), int(first.input_dims)
    if layout is None or layer not in layout.layers:
        return None
    lay = layout.layers[layer]
    out = "down_proj" if "down_proj" in lay.projections else "fc2"
    return lay.num_experts, lay.component(f"{out}.weight").shape[0]


def next_gates(
    model: nn.Module, module_paths: Dict[int, str], layout: Optional[ModelLayout] = None
) -> Dict[int, Tuple[int, nn.Module]]:
    """layer -> (next MoE layer, its router), for every MoE layer whose next MoE layer has a
    router that reads what this layer's experts read.

    Args:
        model: the model (patched or not).
        module_paths: layer -> path of its experts module (``ModelLayout.module_paths``).
        layout: the expert layout (default: ``model.moeflux.layout`` where the model is patched).
    """
    if layout is None:
        layout = getattr(getattr(model, "moeflux", None), "layout", None)
    modules = dict(model.named_modules())
    dims = {i: _dims(modules.get(p), layout, i) for i, p in module_paths.items()}
    layers = sorted(module_paths)
    out = {}
    for cur, nxt in zip(layers, layers[1:]):
        if dims[cur] is None or dims[nxt] is None:
            continue
        found = find_router(model, module_paths[nxt], nxt, dims[nxt][0])
        if found is not None and router_input_dims(found[1]) == dims[cur][1]:
            out[cur] = (nxt, found[1])
    return out


class NextLayerPredictor:
    """``predict(layer, x, k)``: the next MoE layer and the top-``k`` experts its router would
    pick for ``x`` (lazy), or None where no next router is known."""

    def __init__(self, gates: Dict[int, Tuple[int, nn.Module]]):
        self.gates = gates

    def __call__(self, layer: int, x: mx.array, k: int) -> Optional[Tuple[int, mx.array]]:
        ahead = self.gates.get(layer)
        if ahead is None:
            return None
        return ahead[0], predict_experts(ahead[1], x, k)
