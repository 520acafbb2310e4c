"""The drop-in replacement for mlx-lm's ``SwitchGLU`` / ``SwitchMLP``.

The router stays in mlx-lm's model code; this module receives its expert indices, asks the cache
for their slots (``cache.protocol``: one question per call) and runs the expert computation
(``compute``) on them."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn


class StreamingSwitchGLU(nn.Module):
    """Computes what the replaced ``SwitchGLU`` computed, with experts streamed from disk.

    It holds no parameters: the expert weights are not part of the model's state. ``runtime``:
    the model's ``StreamingRuntime`` (cache, backend, counters)."""

    def __init__(self, layer: int, runtime, activation):
        super().__init__()
        self.layer = layer
        self.activation = activation
        self._runtime = runtime  # plain attribute, not a child module

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        rt = self._runtime
        rt.check_open()
        if self.layer == rt.first_layer:  # what the miss server or the GPU ran into since
            rt.cache.check()  # the last forward pass
        waves = None
        if rt.verifying:
            outside = rt.reads_outside(self.layer, x, indices, self.activation)
            waves = rt.cache.waves(self.layer, indices, outside)
        if waves is None:
            return self._experts(x, indices)
        rows = x.reshape(-1, x.shape[-1])
        out = mx.concatenate([self._experts(rows[t : t + 1], w) for t, w in enumerate(waves)])
        return out.reshape(*indices.shape, out.shape[-1])

    def _experts(self, x: mx.array, indices: mx.array) -> mx.array:
        rt = self._runtime
        stats = rt.stats.layer(self.layer)
        slots, pool = rt.cache.lookup(self.layer, x, indices, stats)
        t0 = time.perf_counter()
        backend = rt.backend
        out = backend(x, slots, pool, self.activation)
        served = rt.stats.served_in(self.layer)  # what actually computed it (fallbacks included)
        name = getattr(backend, "last_served", None) or backend.name
        served[name] = served.get(name, 0) + 1
        rt.cache.computed(out)
        stats.compute_s += time.perf_counter() - t0
        return out
