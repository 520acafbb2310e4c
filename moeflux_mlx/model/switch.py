"""The drop-in replacement for mlx-lm's ``SwitchGLU`` / ``SwitchMLP``.

The router stays in mlx-lm's model code; this module receives its expert indices and hands them
to the cache (``cache.expert_cache``: four paths, each visible there) with the expert
computation (``compute``) to run on the slots it finds."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from ..cache.pool import ExpertPool


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
        stats = rt.stats.layer(self.layer)
        if rt.verifying:  # a pass verifying draft tokens: the cache's one seam for it
            outside = rt.reads_outside(self.layer, x, indices, self.activation)
            return rt.cache.verify_pass(self.layer, x, indices, self._compute, stats, outside)
        return rt.cache.call(self.layer, x, indices, self._compute, stats)

    def _compute(self, x: mx.array, slots: mx.array, pool: ExpertPool) -> mx.array:
        """The expert computation on the slots the cache answered with (lazy)."""
        rt = self._runtime
        t0 = time.perf_counter()
        backend = rt.backend
        out = backend(x, slots, pool, self.activation)
        served = rt.stats.served_in(self.layer)  # what actually computed it (fallbacks included)
        name = getattr(backend, "last_served", None) or backend.name
        served[name] = served.get(name, 0) + 1
        rt.stats.layer(self.layer).compute_s += time.perf_counter() - t0
        return out
