"""The drop-in replacement for mlx-lm's ``SwitchGLU`` / ``SwitchMLP``.

The router stays in mlx-lm's model code; this module receives its expert indices, makes the
routed experts resident (store -> cache) and runs the expert computation (backend) on them."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .prefetch import MAX_PREDICT_TOKENS, predict_experts


class StreamingSwitchGLU(nn.Module):
    """Computes what the replaced ``SwitchGLU`` computed, with experts streamed from disk.

    It holds no parameters: the expert weights are not part of the model's state."""

    def __init__(self, layer: int, runtime, activation):
        super().__init__()
        self.layer = layer
        self.activation = activation
        self._runtime = runtime  # plain attribute, not a child module

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        rt = self._runtime
        rt.check_open()
        if self.layer == rt.first_layer:  # what the miss server or the GPU ran into since
            rt.cache.check()              # the last forward pass
        stats = rt.stats.layer(self.layer)
        resident = rt.cache.resident_pool(self.layer)
        if resident is not None:  # every expert resident, slot == expert id: no host sync
            stats.calls += 1
            stats.unsynced_calls += 1
            return rt.backend(x, indices, resident, self.activation)
        if rt.cache.can_resolve(self.layer, indices):  # decode on CUDA: the GPU looks slots up
            ahead = rt.next_gate.get(self.layer) if rt.prefetcher is not None else None
            if ahead is not None and rt.cache.can_hint(ahead[0]):  # the server reads ahead
                predicted = predict_experts(ahead[1], x, indices.shape[-1])
                indices = rt.cache.hint(ahead[0], indices, predicted)
            slots, pool = rt.cache.resolve(self.layer, indices, stats)
            stats.calls += 1
            stats.unsynced_calls += 1
            stats.tokens += 1
            stats.experts_routed += indices.shape[-1]
            out = rt.backend(x, slots, pool, self.activation)
            rt.cache.table_call_done(out)
            return out
        t0 = time.perf_counter()
        ahead = rt.next_gate.get(self.layer) if rt.prefetcher is not None else None
        predicted = None
        if ahead is not None and indices.size // indices.shape[-1] <= MAX_PREDICT_TOKENS:
            predicted = predict_experts(ahead[1], x, indices.shape[-1])
            mx.eval(indices, predicted)  # one sync for both
        idx = np.array(indices)  # the one host sync per MoE layer: which experts were routed
        t1 = time.perf_counter()
        experts, inverse = np.unique(idx, return_inverse=True)
        rt.store.check_experts(self.layer, experts)
        slot_of, pool = rt.cache.fetch(self.layer, experts, stats)
        if predicted is not None:
            nxt = ahead[0]
            rt.prefetcher.submit(nxt, rt.cache.absent(nxt, np.unique(np.array(predicted))))
        t2 = time.perf_counter()
        slots = mx.array(slot_of[inverse].reshape(idx.shape))
        out = rt.backend(x, slots, pool, self.activation)
        mx.async_eval(out)  # the pool's next write must not overtake this read (see cache.py)
        stats.calls += 1
        stats.tokens += int(np.prod(idx.shape[:-1]))
        stats.experts_routed += len(experts)
        stats.sync_s += t1 - t0
        stats.compute_s += time.perf_counter() - t2
        return out
