"""The plain-ops backend: what mlx-lm's ``SwitchGLU`` / ``SwitchMLP`` compute, given resident
expert weights (a slot pool) and slot indices, with the same ``mx.gather_qmm`` / ``mx.gather_mm``
calls stock mlx-lm's ``QuantizedSwitchLinear`` / ``SwitchLinear`` make: every quantization mode
(affine 1-8 bits, mxfp4, nvfp4 with or without its per-expert global scale, mxfp8), each
projection quantized its own way or not at all, expert biases, and the model's own activation
object. It runs everywhere and is bit-identical to stock mlx-lm on the CPU backend (nvfp4's
global scale runs on the GPU only, in MLX as in this backend).
"""

from __future__ import annotations

from typing import Dict, Tuple

import mlx.core as mx
from mlx_lm.models.switch_layers import SwiGLU, _gather_sort, _scatter_unsort

from ..cache.pool import ExpertPool

SORT_THRESHOLD = 64  # SwitchGLU sorts tokens by expert at this many (token, expert) pairs


def _project(x, pool: ExpertPool, proj: str, idx, sorted_indices: bool):
    """One ``QuantizedSwitchLinear`` / ``SwitchLinear`` call, with the pool as its weights."""
    a, q = pool.arrays, pool.quant(proj)
    if q is not None:
        y = mx.gather_qmm(
            x,
            a[f"{proj}.weight"],
            a[f"{proj}.scales"],
            a.get(f"{proj}.biases"),
            rhs_indices=idx,
            transpose=True,
            group_size=q.group_size,
            bits=q.bits,
            mode=q.mode,
            global_scale=a.get(f"{proj}.global_scale"),
            sorted_indices=sorted_indices,
        )
    else:
        y = mx.gather_mm(
            x, a[f"{proj}.weight"].swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sorted_indices
        )
    if f"{proj}.bias" in a:
        y = y + mx.expand_dims(a[f"{proj}.bias"][idx], -2)
    return y


class OpsBackend:
    """Mirrors ``SwitchGLU.__call__`` / ``SwitchMLP.__call__`` call for call."""

    name = "ops"

    def __init__(self, why: str = "requested"):
        self.why = why  # why plain ops compute every layer (``compute.backend.layer_choice``)

    def __call__(self, x: mx.array, slots: mx.array, pool: ExpertPool, activation) -> mx.array:
        if pool.in_place is not None:  # slots may name experts outside the pool
            pool, slots = pool.in_place.gathered(pool, slots)
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
            x = _project(
                activation(_project(x, pool, "fc1", idx, do_sort)), pool, "fc2", idx, do_sort
            )
        if do_sort:
            x = _scatter_unsort(x, inv_order, slots.shape)
        return x.squeeze(-2)


def cast_experts(
    pool: ExpertPool, slots: mx.array, dtypes: Dict[str, mx.Dtype]
) -> Tuple[ExpertPool, mx.array]:
    """``pool`` with the components ``dtypes`` names cast to those dtypes, and ``slots`` to match:
    what stock computes with once ``set_dtype`` has cast its expert weights. A call naming fewer
    experts than the pool holds (decode) casts only those (gathered in call order, computed
    unsorted as before); a larger one casts the whole pool. Lazy, like the computation."""
    if pool.in_place is not None:  # slots may name experts outside the pool
        pool, slots = pool.in_place.gathered(pool, slots)
    n_slots = next(iter(pool.arrays.values())).shape[0]
    gather = slots.size < min(SORT_THRESHOLD, n_slots)
    flat = slots.flatten()
    arrays = {}
    for name, arr in pool.arrays.items():
        if gather:
            arr = arr[flat]
        arrays[name] = arr.astype(dtypes[name]) if name in dtypes else arr
    if gather:
        slots = mx.arange(slots.size, dtype=mx.uint32).reshape(slots.shape)
    return ExpertPool(arrays, pool.quantization, pool.overrides), slots


def is_plain_swiglu(activation) -> bool:
    return type(activation) is SwiGLU
