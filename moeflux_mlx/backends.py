"""Expert computation backends: given resident expert weights (a slot pool) and slot indices,
compute what mlx-lm's ``SwitchGLU`` / ``SwitchMLP`` compute.

``ops``     plain MLX ops (``mx.gather_qmm``), the same calls stock mlx-lm makes: runs everywhere,
            and is bit-identical to stock mlx-lm on the CPU backend.
``metal`` / ``cuda``  the fused kernels of ``moeflux_mlx.kernels`` (4/8-bit affine, SwiGLU); shapes
            they do not cover fall back to ``ops``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Dict, Optional

import mlx.core as mx
from mlx_lm.models.switch_layers import SwiGLU, _gather_sort, _scatter_unsort

from .layout import ExpertLayout, Quantization

log = logging.getLogger(__name__)

MX_DTYPES = {
    "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16, "U32": mx.uint32,
    "I32": mx.int32, "U64": mx.uint64, "I64": mx.int64, "F16": mx.float16,
    "BF16": mx.bfloat16, "F32": mx.float32, "BOOL": mx.bool_,
}
SORT_THRESHOLD = 64  # SwitchGLU sorts tokens by expert at this many (token, expert) pairs


@dataclass
class ExpertPool:
    """Expert weights resident in MLX memory: ``arrays[name]`` is ``[n_slots, *shape]``."""

    arrays: Dict[str, mx.array]
    quantization: Optional[Quantization]  # of gate/up (fc1)
    overrides: Dict[str, Quantization] = field(default_factory=dict)  # projections that differ
    # per call shape, what a backend worked out once for this pool (kernels.KernelBackend)
    plans: Dict[tuple, object] = field(default_factory=dict, repr=False, compare=False)

    def quant(self, projection: str) -> Optional[Quantization]:
        return self.overrides.get(projection, self.quantization)

    @classmethod
    def from_blobs(cls, blobs: mx.array, layout: ExpertLayout) -> "ExpertPool":
        """Typed views of ``[n, blob_size]`` uint8 blobs, one array per component."""
        n = blobs.shape[0]
        arrays = {}
        for c in layout.components:
            raw = blobs[:, c.offset:c.offset + c.nbytes]
            arrays[c.name] = raw.view(MX_DTYPES[c.dtype]).reshape(n, *c.shape)
        return cls(arrays, layout.quantization, layout.overrides)

    @property
    def is_glu(self) -> bool:
        return "gate_proj.weight" in self.arrays


def _project(x, pool: ExpertPool, proj: str, idx, sorted_indices: bool):
    """One ``QuantizedSwitchLinear`` / ``SwitchLinear`` call, with the pool as its weights."""
    a, q = pool.arrays, pool.quant(proj)
    if q is not None:
        y = mx.gather_qmm(x, a[f"{proj}.weight"], a[f"{proj}.scales"], a.get(f"{proj}.biases"),
                          rhs_indices=idx, transpose=True, group_size=q.group_size, bits=q.bits,
                          mode=q.mode, sorted_indices=sorted_indices)
    else:
        y = mx.gather_mm(x, a[f"{proj}.weight"].swapaxes(-1, -2), rhs_indices=idx,
                         sorted_indices=sorted_indices)
    if f"{proj}.bias" in a:
        y = y + mx.expand_dims(a[f"{proj}.bias"][idx], -2)
    return y


class OpsBackend:
    """Mirrors ``SwitchGLU.__call__`` / ``SwitchMLP.__call__`` call for call."""

    name = "ops"

    def __call__(self, x: mx.array, slots: mx.array, pool: ExpertPool, activation) -> mx.array:
        x = mx.expand_dims(x, (-2, -3))
        do_sort = slots.size >= SORT_THRESHOLD
        idx, inv_order = slots, None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, slots)
        if pool.is_glu:
            x_up = _project(x, pool, "up_proj", idx, do_sort)
            x_gate = _project(x, pool, "gate_proj", idx, do_sort)
            x = _project(activation(x_up, x_gate), pool, "down_proj", idx, do_sort)
        else:
            x = _project(activation(_project(x, pool, "fc1", idx, do_sort)), pool, "fc2", idx, do_sort)
        if do_sort:
            x = _scatter_unsort(x, inv_order, slots.shape)
        return x.squeeze(-2)


def is_plain_swiglu(activation) -> bool:
    return type(activation) is SwiGLU


BACKENDS = ("auto", "ops", "metal", "cuda")


def select_backend(name: Optional[str] = None):
    """``auto``: Metal kernels on Metal, CUDA kernels on CUDA, plain ops on the CPU.

    ``MOEFLUX_BACKEND`` overrides ``auto`` (for benchmarking)."""
    name = name or os.environ.get("MOEFLUX_BACKEND") or "auto"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        if mx.default_device() == mx.cpu:
            name = "ops"
        elif mx.metal.is_available():
            name = "metal"
        elif mx.cuda.is_available():
            name = "cuda"
        else:
            name = "ops"
    if name == "ops":
        return OpsBackend()
    from .kernels import KernelBackend  # imported lazily: it compiles kernels on first use

    return KernelBackend(dialect=name, fallback=OpsBackend())
