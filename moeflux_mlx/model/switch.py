"""The drop-in replacement for mlx-lm's ``SwitchGLU`` / ``SwitchMLP``.

The router stays in mlx-lm's model code; this module receives its expert indices and hands them
to the cache (``cache.expert_cache``: four paths, each visible there) with the expert
computation (``compute``) to run on the slots it finds."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn

from ..cache.pool import MX_DTYPES, ExpertPool
from ..compute.ops import OpsBackend, cast_experts

FLOATING = ("F16", "BF16", "F32")  # expert components whose dtype set_dtype changes in stock
_OPS = OpsBackend("the expert weights are cast to the dtype set on the model")


@dataclass
class _CastMemo:
    """``_cast_to``'s last answer and the marker arrays it was worked out from (a plain object:
    ``nn.Module`` keeps a dict, list or tuple attribute in the model's state)."""

    markers: List[mx.array]
    cast: Dict[str, mx.Dtype]


class StreamingSwitchGLU(nn.Module):
    """Computes what the replaced ``SwitchGLU`` computed, with experts streamed from disk.

    The expert weights are not part of the model's state. Its only parameters, once
    ``track_dtypes`` made them, are empty arrays (no element) in ``expert_dtypes``, one per
    floating expert component (scales, biases, unquantized weights), of that component's
    dtype: ``model.set_dtype`` and ``model.update`` cast them as they would cast stock's
    ``SwitchGLU`` weights, and the experts are then computed with their components cast to
    those dtypes (plain ops), as stock computes with its cast weights. ``runtime``: the model's
    ``StreamingRuntime`` (cache, backend, counters)."""

    def __init__(self, layer: int, runtime, activation):
        super().__init__()
        self.layer = layer
        self.activation = activation
        self._runtime = runtime  # plain attribute, not a child module
        self._cast_memo = _CastMemo([], {})

    def track_dtypes(self) -> None:
        """Make the ``expert_dtypes`` markers (after the model's weights are loaded: mlx-lm's
        strict load would call them missing weights)."""
        markers: Dict[str, Dict[str, mx.array]] = {}
        for c in self._runtime.layout.layers[self.layer].components:
            if c.dtype in FLOATING:
                proj, name = c.name.rsplit(".", 1)
                markers.setdefault(proj, {})[name] = mx.zeros((0,), MX_DTYPES[c.dtype])
        self.expert_dtypes = markers

    def _cast_to(self) -> Dict[str, mx.Dtype]:
        """The components whose dtype was set otherwise on the model than the files hold (every
        pool of the layer holds the files' dtypes). Worked out again only when a marker changes:
        comparing the dtypes on every call cost about half of a resident layer call's host time."""
        if "expert_dtypes" not in self:
            return {}
        markers = [m for arrays in self["expert_dtypes"].values() for m in arrays.values()]
        memo = self._cast_memo  # stale once set_dtype / update (any assignment) replace a marker
        if len(markers) == len(memo.markers) and all(map(operator.is_, markers, memo.markers)):
            return memo.cast
        files = {c.name: c.dtype for c in self._runtime.layout.layers[self.layer].components}
        cast = {
            f"{proj}.{name}": marker.dtype
            for proj, arrays in self["expert_dtypes"].items()
            for name, marker in arrays.items()
            if MX_DTYPES[files[f"{proj}.{name}"]] != marker.dtype
        }
        self._cast_memo = _CastMemo(markers, cast)
        return cast

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        rt = self._runtime
        rt.check_open()
        if self.layer == rt.first_layer:  # what the miss server or the GPU ran into since
            rt.cache.check()  # the last forward pass
        stats = rt.stats.layer(self.layer)
        if rt.routing_sink is not None:  # a calibration records the routing (model.calibrate)
            rt.routing_sink(self.layer, indices)
        if rt.verifying:  # a pass verifying draft tokens: the cache's one seam for it
            outside = rt.reads_outside(self.layer, x, indices, self.activation)
            return rt.cache.verify_pass(self.layer, x, indices, self._compute, stats, outside)
        return rt.cache.call(self.layer, x, indices, self._compute, stats)

    def _compute(self, x: mx.array, slots: mx.array, pool: ExpertPool) -> mx.array:
        """The expert computation on the slots the cache answered with (lazy)."""
        rt = self._runtime
        t0 = time.perf_counter()
        # a child module lives in the module's dict (self.activation would reach it through
        # nn.Module.__getattr__, after a failed lookup: ~1 us); a plain function is an attribute
        activation = self.get("activation")
        if activation is None:
            activation = self.activation
        cast = self._cast_to()
        if cast:
            pool, slots = cast_experts(pool, slots, cast)
            out = _OPS(x, slots, pool, activation)
            name = f"ops (fallback: {_OPS.why})"
        else:
            backend = rt.backend
            out = backend(x, slots, pool, activation)
            name = getattr(backend, "last_served", None) or backend.name
        stats = rt.stats
        served = stats.served_in(self.layer)  # what actually computed it (fallbacks included)
        served[name] = served.get(name, 0) + 1
        stats.layer(self.layer).compute_s += time.perf_counter() - t0
        return out
