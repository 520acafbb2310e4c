"""Replay recorded routing in another model: real reuse and skew at real expert sizes.

The trained demo model routes like a trained model, but its experts are small (55 kB); a
full-size random model has real expert sizes (2.65 MB for Qwen3-30B-A3B at 4 bits) but routes at chance.
``drive_routing`` joins the two for the decode benchmark: each MoE layer's router is replaced by
a ``TraceRouter`` that makes the experts a ``RoutingTrace`` recorded (``benchmark.routing``) the
layer's top-k, position after position, so the cache sees the trained model's I/O pattern at
the big model's sizes. The tokens such a model outputs are meaningless by design; stock mlx-lm
and moeflux-mlx given the same routers still compute the same thing, so exactness and speed are
compared as usual.

A model with more MoE layers than the trace reuses the trace's layers in turn, each reuse
starting at another position of the trace so that no two layers replay the same sequence.

"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from benchmarks.lib.routing import RoutingTrace
from moeflux_mlx.errors import MoefluxError
from moeflux_mlx.model.experts import find_experts, find_router
from moeflux_mlx.model.switch import StreamingSwitchGLU

# what a report says of a run whose routing was replayed
REPLAYED_ROUTING = (
    "real reuse and skew at this model's expert sizes; the output tokens are meaningless by design"
)

# Far below any real logit: after the softmax the traced experts hold all the weight.
_OFF = -30.0


class TraceRoutingError(MoefluxError, ValueError):
    """The trace cannot drive this model's routers (expert counts, top-k, router kind)."""


def logit_rows(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """``[tokens, num_experts]`` logits whose top-k at each position are ``experts`` (``[tokens,
    top_k]``): 0 for the traced experts, far below everywhere else."""
    rows = np.full((experts.shape[0], num_experts), _OFF, np.float32)
    np.put_along_axis(rows, experts.astype(np.int64), 0.0, axis=1)
    return rows


class TraceRouter(nn.Module):
    """A router whose logits make the traced experts of each position its top-k.

    Args:
        rows: ``[tokens, experts]`` logits (``logit_rows``), replayed from ``start`` and
            wrapping; routers replaying the same trace layer share them.
        start: the first position to replay.
    """

    def __init__(self, rows: np.ndarray, start: int = 0):
        super().__init__()
        self._rows = rows  # plain attribute: not a parameter, never saved or quantized
        self._start = self._pos = start % rows.shape[0]

    def rewind(self, shift: int = 0) -> None:
        """Replay from ``shift`` positions past ``start`` (0: as the first time)."""
        self._pos = (self._start + shift) % self._rows.shape[0]

    def __call__(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        n = int(np.prod(lead)) if lead else 1
        idx = (self._pos + np.arange(n)) % self._rows.shape[0]
        self._pos = int((self._pos + n) % self._rows.shape[0])
        return mx.array(self._rows[idx].reshape(*lead, -1)).astype(x.dtype)


def _expert_sites(model: nn.Module) -> List[Tuple[str, int]]:
    """(path, decoder layer) of every routed-experts module, streamed or stock, in model order."""
    streamed = [(p, m.layer) for p, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)]
    if streamed:
        return sorted(streamed, key=lambda s: s[1])
    return [(p, e.layer) for p, e in find_experts(model).items()]


def drive_routing(
    model: nn.Module,
    trace: RoutingTrace,
    where: Union[str, Path] = "trace",
    moe_layers: Optional[Sequence[int]] = None,
) -> int:
    """Replace every MoE layer's router of ``model`` by a ``TraceRouter`` over ``trace``.

    Args:
        model: an mlx-lm model, stock or loaded by ``moeflux_mlx.load``.
        trace: the routing to replay; its experts per layer and top-k must be the model's.
        where: the trace's name, for messages.
        moe_layers: the decoder layers of the whole model's MoE layers, where ``model`` holds
            only some of them (a pipeline stage): each layer then replays what it replays in
            the whole model. None: the model's own.

    Returns:
        The number of routers replaced.

    Raises:
        TraceRoutingError: the model has another number of experts or top-k than the trace, or
            a router that is not a plain linear layer (DeepSeek's ``MoEGate`` picks its own); or
            the model holds a layer ``moe_layers`` lacks.
    """
    sites = _expert_sites(model)
    order = list(moe_layers) if moe_layers is not None else [layer for _, layer in sites]
    strays = sorted({layer for _, layer in sites} - set(order))
    if strays:
        raise TraceRoutingError(f"{where}: MoE layers {strays} are not among {order}")
    n_layers = len(trace.layers)
    experts = trace.num_experts[0]
    if len(set(trace.num_experts)) != 1:
        raise TraceRoutingError(f"{where}: layers with different numbers of experts")
    replaced = []
    tokens = trace.routed.shape[0]
    rows = [logit_rows(trace.routed[:, j], experts) for j in range(n_layers)]
    for path, layer in sites:
        j = order.index(layer)  # the layer's place in the whole model
        found = find_router(model, path, layer, experts)
        if found is None:
            raise TraceRoutingError(
                f"{where}: layer {layer} has no router onto {experts} experts (the trace has "
                f"{experts}; build the model with --set num_experts={experts})"
            )
        router_path, router = found
        if not isinstance(router, (nn.Linear, nn.QuantizedLinear)):
            raise TraceRoutingError(
                f"layer {layer}: its router ({type(router).__name__}) chooses experts itself; "
                "a trace can drive only a linear router"
            )
        k = _top_k(model, router_path)
        if k is not None and k != trace.top_k:
            raise TraceRoutingError(
                f"{where}: top-{trace.top_k}, the model's layer {layer} routes top-{k}"
            )
        # another reuse of the same trace layer starts elsewhere, so layers do not move together
        start = (j // n_layers) * (tokens // max(1, -(-len(order) // n_layers)))
        replaced.append((router_path, TraceRouter(rows[j % n_layers], start)))
    model.update_modules(tree_unflatten(replaced))
    return len(replaced)


def rewind_routing(model: nn.Module, shift: int = 0) -> int:
    """Send every ``TraceRouter`` of ``model`` to ``shift`` positions past where its replay
    started, so that models compared round by round see the same routing.

    Args:
        model: a model ``drive_routing`` prepared.
        shift: positions past each router's start (0: route as the first pass did).

    Returns:
        The number of routers moved (0: the model replays no trace).
    """
    routers = [m for _, m in model.named_modules() if isinstance(m, TraceRouter)]
    for r in routers:
        r.rewind(shift)
    return len(routers)


def _top_k(model: nn.Module, router_path: str):
    """The top-k of the block holding the router, where it says (``top_k``,
    ``num_experts_per_tok``)."""
    block: nn.Module = model
    for part in router_path.split(".")[:-1]:
        block = block[int(part)] if isinstance(block, list) else block[part]
    for name in ("top_k", "num_experts_per_tok"):
        value = getattr(block, name, None)
        if isinstance(value, int):
            return value
    return None


def load_trace(path: Union[str, Path]) -> RoutingTrace:
    """``RoutingTrace.load`` with the project's error type.

    Args:
        path: a trace written by ``benchmarks/cache_policy.py`` (``.npz``).

    Returns:
        The trace.

    Raises:
        TraceRoutingError: the file is missing or is not a routing trace.
    """
    try:
        return RoutingTrace.load(path)
    except (OSError, ValueError, KeyError) as e:
        raise TraceRoutingError(f"{path}: not a readable routing trace ({e})") from None
