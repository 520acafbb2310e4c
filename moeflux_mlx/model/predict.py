"""Which experts the next MoE layer will route to, predicted from this layer's MoE input.

The prediction for the next MoE layer is its own router applied to this layer's input (the
offloading literature reports high recall for this on trained models). It is built lazily, next
to this layer's router indices, so evaluating both costs one host sync; the caches hand it to
their read-ahead (``io.prefetch`` on the synced path, the miss server on the device-side table).

Routers are found as the experts are (``model.experts.find_router``): the linear map onto the
next layer's experts in its decoder layer, whatever the architecture calls it. A router that
reads another size than this layer's experts do (e.g. nemotron_h's latent experts) predicts
nothing.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..format.layout import ModelLayout
from .experts import expert_projections, find_router, router_input_dims


def predict_experts(gate: nn.Module, x: mx.array, k: int) -> mx.array:
    """Top-``k`` experts the router ``gate`` would pick for ``x`` (lazy)."""
    out = gate(x)
    if isinstance(out, tuple):  # DeepSeek's MoEGate returns (indices, scores)
        return out[0]
    return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]


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
