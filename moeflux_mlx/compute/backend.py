"""Choosing the expert computation: ``select_backend``, the ``Backend`` protocol, and
``layer_choice``: which backend a layer's decode calls run on, and why."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Dict, Optional, Protocol, Tuple

import mlx.core as mx

from ..cache.pool import ExpertPool
from ..options import BACKENDS
from .kernels import FLOAT_DTYPES, ExpertSpec, KernelBackend, expert_route, failed_check
from .ops import OpsBackend

log = logging.getLogger(__name__)
_WARNED: set = set()  # requested backends that could not run here, warned about once


class Backend(Protocol):
    """``backend(x, slots, pool, activation)``: what the replaced ``SwitchGLU`` computes for
    ``x [..., H]`` routed to ``slots [..., K]`` of ``pool``: ``[..., K, H]`` in ``x.dtype``."""

    name: str

    def __call__(self, x: mx.array, slots: mx.array, pool: ExpertPool, activation) -> mx.array: ...


def select_backend(name: Optional[str] = None) -> Backend:
    """The expert computation for ``name``.

    Args:
        name: ``auto`` (or None): Metal kernels on Metal, CUDA kernels on CUDA, plain ops on the
            CPU; ``ops``, ``metal`` or ``cuda``.

    Returns:
        ``OpsBackend``, or a ``KernelBackend`` that falls back to it for what the kernels do not
        cover (the kernels compile on first use).

    Raises:
        ValueError: an unknown name.
    """
    name = name or "auto"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    ops_why = "requested (backend ops)"
    if name == "auto":
        name, ops_why = _auto()
    if name == "ops":
        return OpsBackend(ops_why)
    backend = KernelBackend(dialect=name, fallback=OpsBackend())
    why = backend.unavailable_reason()
    if why is not None and name not in _WARNED:  # asked for by name: accepted, said once
        _WARNED.add(name)
        log.warning("backend %r requested, but %s: plain MLX ops compute the experts", name, why)
    return backend


def _auto() -> Tuple[str, str]:
    """``auto``'s pick on this machine, and why when it is plain ops."""
    if mx.default_device() == mx.cpu:
        return "ops", "no GPU: MLX's default device is the CPU"
    if mx.metal.is_available():
        return "metal", ""
    if mx.cuda.is_available():
        return "cuda", ""
    return "ops", "no GPU: this MLX has neither a Metal nor a CUDA backend"


def gpu_dialect() -> str:
    """The kernels' dialect on a GPU of this platform.

    Returns:
        ``"metal"`` on macOS (or where MLX has Metal), else ``"cuda"``.
    """
    if mx.metal.is_available() or sys.platform == "darwin":
        return "metal"
    return "cuda"


def quant_label(spec: ExpertSpec) -> str:
    """How a layer's experts are quantized, in words.

    Args:
        spec: the layer's experts (gate/up's quantization; projections quantized otherwise
            are ``expert_route``'s business).

    Returns:
        e.g. ``"affine 4-bit, group 64"``, ``"mxfp4 4-bit, group 32"``, ``"unquantized"``.
    """
    q = spec.quantization
    return "unquantized" if q is None else f"{q.mode} {q.bits}-bit, group {q.group_size}"


@dataclass(frozen=True)
class LayerChoice:
    """What computes one MoE layer's decode calls on this machine, and why.

    ``backend``: ``"metal"`` / ``"cuda"`` (the fused kernels) or ``"ops"``. ``reason``: for the
    kernels, what they run (quantization, the self-check's state); for ops, why (the fused
    kernels do not take the layer, a failed self-check, no GPU, ops requested). ``on_gpu``:
    only where ops run for the machine or the option, not for the layer: what the fused kernels
    would do with it (``None`` where that is not the question)."""

    backend: str
    reason: str
    on_gpu: Optional[str] = None

    def __str__(self) -> str:
        what = f"{self.backend} kernels" if self.backend != "ops" else "ops"
        extra = f"; {self.on_gpu}" if self.on_gpu else ""
        return f"{what} ({self.reason}{extra})"


def _verdict_note(
    backend: KernelBackend, spec: ExpertSpec, dtype, topk: Optional[int]
) -> Tuple[bool, str]:
    """``(failed, note)``: what this machine's self-check recorded for the layer's decode
    variants (one token; ``dtype`` None: any float dtype), without running it."""
    if topk is None:
        return False, "self-check at first use"
    ran = []
    for dt in [dtype] if dtype is not None else list(FLOAT_DTYPES):
        variant = backend.variant_of(spec, dt, mx.uint32, topk, 1)
        verdict = backend.recorded_verdict(variant)
        if verdict is not None and not verdict.ok:
            return True, failed_check(variant, verdict)
        ran.append(verdict is not None)
    return False, "self-check passed" if any(ran) else "self-check at first use"


def layer_choice(
    backend, spec: ExpertSpec, activation, *, dtype=None, topk: Optional[int] = None
) -> LayerChoice:
    """Which backend computes a layer's decode calls (one token) on this machine, and why: the
    decision ``KernelBackend`` makes at the layer's first call (``expert_route``, then the
    self-check's verdict), asked without computing anything.

    Args:
        backend: what ``select_backend`` returned.
        spec: the layer's experts (``ExpertSpec.of_layout`` before loading, ``of_pool`` after).
        activation: the layer's activation object (the model's ``SwitchGLU.activation``).
        dtype: the activation dtype (the model's); None: any float dtype.
        topk: experts per token; None: the self-check's verdicts are not looked up.

    Returns:
        A ``LayerChoice``.

    Raises:
        ValueError: ``backend`` is a ``KernelBackend`` of an unknown dialect.
    """
    if not isinstance(backend, KernelBackend):
        why = getattr(backend, "why", "requested")
        dialect = gpu_dialect()
        return LayerChoice(backend.name, why, _on_gpu(dialect, spec, activation))
    unavailable = backend.unavailable_reason()
    if unavailable is not None:
        return LayerChoice("ops", unavailable, _on_gpu(backend.dialect, spec, activation))
    why = expert_route(backend.dialect, spec, activation)
    if why is not None:
        return LayerChoice("ops", why)
    if not backend.selfcheck:
        return LayerChoice(backend.dialect, quant_label(spec))
    failed, note = _verdict_note(backend, spec, dtype, topk)
    if failed:
        return LayerChoice("ops", note)
    return LayerChoice(backend.dialect, f"{quant_label(spec)}; {note}")


def _on_gpu(dialect: str, spec: ExpertSpec, activation) -> str:
    why = expert_route(dialect, spec, activation)
    if why is None:
        return f"on a GPU: {dialect} kernels, {quant_label(spec)}"
    return f"on a GPU: ops too, {why}"


def backend_report(backend) -> str:
    """What computes the experts, before any call: ``"metal"``, ``"cuda"``, ``"ops"``, or
    ``"ops (fallback: <why>)"`` when the requested kernels cannot run here."""
    report = getattr(backend, "report", None)
    return report() if callable(report) else str(getattr(backend, "name", type(backend).__name__))


def served_summary(served: Dict[str, int], before: str) -> str:
    """One line for ``served`` (calls per backend that actually computed them, from
    ``Stats.served_total``): the backend when one served every call, else each with its share
    of the calls; ``before`` (``backend_report``) while no call was made."""
    if not served:
        return before
    if len(served) == 1:
        return next(iter(served))
    total = sum(served.values())
    parts = sorted(served.items(), key=lambda kv: -kv[1])
    return "; ".join(f"{name}: {100 * n / total:.0f}% of calls" for name, n in parts)
