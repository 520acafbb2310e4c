"""Expert computations changed on purpose, to show what ``moeflux-mlx compare``'s rules pass and
what they fail: two errors of the kind a kernel can make, and one difference of rounding alone.

Each patches ``StreamingSwitchGLU._compute``, the one call through which every backend's expert
output reaches the model (plain ops on the CPU, the fused kernels on a GPU), so the same variant
breaks whichever backend runs; stock mlx-lm and the float32 reference are untouched.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Collection, Iterator, Optional

import mlx.core as mx

from moeflux_mlx.model.switch import StreamingSwitchGLU

# kind -> what it does, for the scripts that list them
VARIANTS = {
    "scale": "every expert's output multiplied by a factor (a wrong scale)",
    "wrong-expert": "each token's first routed expert computed as its second (a wrong expert; "
    "every layer, or those given)",
    "rounding": "experts computed in float32, then rounded to the activations' dtype "
    "(no error: another rounding; plain ops only)",
}


@contextmanager
def expert_variant(
    kind: str, factor: float = 1.25, layers: Optional[Collection[int]] = None
) -> Iterator[None]:
    """Streamed models loaded and run inside compute their experts as ``kind`` says.

    Args:
        kind: a key of ``VARIANTS``.
        factor: the scale of ``"scale"``.
        layers: the layer indices whose experts change (default: every layer); the others
            compute as usual. One layer of many is the smallest error of its kind, the one
            a rule's margin has to catch.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in VARIANTS:
        raise ValueError(f"unknown variant {kind!r}; one of {', '.join(VARIANTS)}")
    original = StreamingSwitchGLU._compute
    changed = None if layers is None else frozenset(layers)

    def compute(self, x: mx.array, slots: mx.array, pool) -> mx.array:
        if changed is not None and self.layer not in changed:
            return original(self, x, slots, pool)
        if kind == "scale":
            return original(self, x, slots, pool) * factor
        if kind == "wrong-expert":  # slots: (..., top_k) cache slots in routing order
            slots = mx.concatenate([slots[..., 1:2], slots[..., 1:]], axis=-1)
            return original(self, x, slots, pool)
        return original(self, x.astype(mx.float32), slots, pool).astype(x.dtype)

    StreamingSwitchGLU._compute = compute  # type: ignore[method-assign]
    try:
        yield
    finally:
        StreamingSwitchGLU._compute = original  # type: ignore[method-assign]
