"""Choosing the expert computation: ``select_backend`` and the ``Backend`` protocol."""

from __future__ import annotations

from typing import Optional, Protocol

import mlx.core as mx

from ..cache.pool import ExpertPool
from ..options import BACKENDS
from .kernels import KernelBackend
from .ops import OpsBackend


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
    return KernelBackend(dialect=name, fallback=OpsBackend())
