"""Per-layer counters of the streaming path: what was read, and where the time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Dict, Optional


@dataclass
class LayerStats:
    calls: int = 0  # SwitchGLU calls (one per forward pass of the layer)
    # of those, answered with no host sync: every expert resident, the device-side table, or
    # a prefill's whole layer
    unsynced_calls: int = 0
    resident_calls: int = 0  # of those, on a layer whose every expert is resident
    tokens: int = 0  # tokens of every call (the router's rows)
    # experts the router asked for: a synced call's unique ones; a call to a fully resident
    # layer (no sync) and a device-side table call count their selections (tokens x top-k)
    experts_routed: int = 0
    experts_missed: int = 0  # of those, not resident when asked (a resident layer's: none)
    # the device-side table's miss server reads a speculative pass's later tokens' experts
    # ahead, once the pass's first token announces them (``table_kernels.hint``)
    prefetch_issued: int = 0  # experts read ahead so
    prefetch_hits: int = 0  # misses whose bytes such a read ahead had already read
    prefetch_failed: int = 0  # reads ahead that failed and were read again directly
    experts_read: int = 0  # blobs read from disk (misses, whole-layer fills, prefetches)
    bytes_read: int = 0
    sync_s: float = 0.0  # waiting for the router's indices (device -> host)
    io_s: float = 0.0  # reading experts from disk into host memory
    upload_s: float = 0.0  # host -> MLX memory, and slot updates
    compute_s: float = 0.0  # building the expert computation (lazy; device time lands in sync_s)
    gpu_waits: int = 0  # device-side table: decode calls whose GPU waited for the miss server
    gpu_wait_s: float = 0.0  # the GPU's time in those waits (the server's reads included)

    def add(self, other: LayerStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class Stats:
    layers: Dict[int, LayerStats] = field(default_factory=dict)
    # per layer, what actually computed its calls: "metal", "cuda", "ops", or
    # "ops (fallback: <why>)" when the kernels did not take a call (counted per call)
    served: Dict[int, Dict[str, int]] = field(default_factory=dict)

    def layer(self, i: int) -> LayerStats:
        if i not in self.layers:
            self.layers[i] = LayerStats()
        return self.layers[i]

    def served_in(self, i: int) -> Dict[str, int]:
        """The per-backend call counts of layer ``i`` (the streaming module adds to them)."""
        if i not in self.served:
            self.served[i] = {}
        return self.served[i]

    def served_total(self) -> Dict[str, int]:
        """Calls per backend over every layer."""
        out: Dict[str, int] = {}
        for counts in self.served.values():
            for name, n in counts.items():
                out[name] = out.get(name, 0) + n
        return out

    def total(self) -> LayerStats:
        t = LayerStats()
        for s in self.layers.values():
            t.add(s)
        return t

    @property
    def hit_rate(self) -> Optional[float]:
        """Of the experts routed, the share already resident: every selection of a call to a
        fully resident layer is a hit (the first call of such a layer, which reads it whole,
        counts its experts as misses); None before any call counted an expert."""
        t = self.total()
        return 1.0 - t.experts_missed / t.experts_routed if t.experts_routed else None

    def to_dict(self) -> dict:
        total = asdict(self.total())
        total["hit_rate"] = self.hit_rate
        layers = {}
        for i, s in sorted(self.layers.items()):
            layers[i] = asdict(s)
            layers[i]["backend"] = dict(self.served.get(i, {}))
        return {"total": total, "layers": layers, "served": self.served_total()}

    def reset(self) -> None:
        self.layers.clear()
        self.served.clear()
