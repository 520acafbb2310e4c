"""Which experts the next MoE layer will route to, predicted from this layer's MoE input.

The prediction for the next MoE layer is its own router applied to this layer's input (the
offloading literature reports high recall for this on trained models). It is built lazily, next
to this layer's router indices, so evaluating both costs one host sync; the caches hand it to
their read-ahead (``io.prefetch`` on the synced path, the miss server on the device-side table).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn


def predict_experts(gate: nn.Module, x: mx.array, k: int) -> mx.array:
    """Top-``k`` experts the router ``gate`` would pick for ``x`` (lazy)."""
    out = gate(x)
    if isinstance(out, tuple):  # DeepSeek's MoEGate returns (indices, scores)
        return out[0]
    return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]


def next_gates(model: nn.Module, module_paths: Dict[int, str]) -> Dict[int, Tuple[int, nn.Module]]:
    """layer -> (next MoE layer, its router), where the router is the ``gate`` beside the
    next layer's ``switch_mlp`` (the name every mlx-lm MoE block here uses)."""
    modules = dict(model.named_modules())
    layers = sorted(module_paths)
    out = {}
    for cur, nxt in zip(layers, layers[1:]):
        gate: Optional[nn.Module] = getattr(
            modules.get(module_paths[nxt].rsplit(".", 1)[0]), "gate", None
        )
        if gate is not None:
            out[cur] = (nxt, gate)
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
