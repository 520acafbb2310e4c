"""Choosing the expert computation: ``select_backend`` and the ``Backend`` protocol."""

from __future__ import annotations

import logging
from typing import Dict, Optional, Protocol

import mlx.core as mx

from ..cache.pool import ExpertPool
from ..options import BACKENDS
from .kernels import KernelBackend
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
    backend = KernelBackend(dialect=name, fallback=OpsBackend())
    why = backend.unavailable_reason()
    if why is not None and name not in _WARNED:  # asked for by name: accepted, said once
        _WARNED.add(name)
        log.warning("backend %r requested, but %s: plain MLX ops compute the experts", name, why)
    return backend


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
