"""Memory macOS will not page out: the slot pools and staging fitted into Metal's recommended
working set, and wired while the model is open.

On Apple silicon the GPU's memory is the system's, and macOS may compress or page out MLX's
buffers under pressure; a slot pool that is paged out is read back from swap at every hit,
which is slower than the expert files themselves. MLX keeps its buffers resident up to a *wired
limit* (``mx.set_wired_limit``; at most the recommended working set,
``mx.device_info()["max_recommended_working_set_size"]``), and mlx-lm raises the limit to the
recommended working set for the length of each generation (``mlx_lm.generate.wired_limit``).
Here:

* ``fit_budget``: a cache budget is cut so that the pools, the staging and the dense weights
  fit the recommended working set (with ``HEADROOM`` of it left for the KV cache and
  activations), with a note saying so; nothing changes where there is no working set (CPU,
  CUDA).
* ``Wiring``: while a model is open, the wired limit is raised to cover its pools and staging
  (never above the recommended working set, never lowered), and put back at ``close()``; so the
  pools stay resident between generations too, and for code that calls the model without
  mlx-lm's ``generate``.

``MetalMemory`` is the only part that talks to MLX; tests hand in a stand-in.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import mlx.core as mx

log = logging.getLogger(__name__)

HEADROOM = 0.10  # of the working set, left for the KV cache, activations and MLX's own buffers
STAGING_CAP = 256 << 20  # staging kept between calls (cache.pool.STAGING_KEEP_BYTES)


class MetalMemory:
    """MLX's Metal memory controls (absent elsewhere: ``available()`` is False)."""

    def available(self) -> bool:
        return bool(mx.metal.is_available())

    def working_set(self) -> Optional[int]:
        if not self.available():
            return None
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        ws = info.get("max_recommended_working_set_size")
        return int(ws) if ws else None

    def set_wired_limit(self, limit: int) -> int:
        return int(mx.set_wired_limit(limit))

    def wired_limit(self) -> int:
        """The current limit (MLX can only tell it by setting one: set and put back)."""
        old = self.set_wired_limit(0)
        self.set_wired_limit(old)
        return old


def staging_bytes_estimate(layout) -> int:
    """Host staging a cache keeps between calls: at most ``STAGING_CAP``; for a known layout,
    no more than one layer's experts."""
    if layout is None:
        return STAGING_CAP
    largest = max((lay.layer_bytes for lay in layout.layers.values()), default=0)
    return min(STAGING_CAP, largest)


def fit_budget(
    budget_bytes: int,
    staging_bytes: int,
    working_set: Optional[int],
    reserved_bytes: int = 0,
) -> Tuple[int, Optional[str]]:
    """``budget_bytes`` cut so that budget + staging + ``reserved_bytes`` (the dense weights,
    when known) + ``HEADROOM`` x working set <= ``working_set``. Returns ``(budget, note)``,
    ``note`` None when nothing was cut (or there is no working set to fit: CPU, CUDA)."""
    if not working_set or budget_bytes <= 0:
        return budget_bytes, None
    room = int(working_set * (1 - HEADROOM)) - staging_bytes - reserved_bytes
    room = max(room, 0)
    if budget_bytes <= room:
        return budget_bytes, None
    return room, (
        f"cut from {budget_bytes / 1e9:.2f} GB to {room / 1e9:.2f} GB to fit the recommended "
        f"working set ({working_set / 1e9:.2f} GB, less {HEADROOM:.0%} headroom, "
        f"{staging_bytes / 1e9:.2f} GB staging and {reserved_bytes / 1e9:.2f} GB dense weights): "
        "beyond it macOS may page the pools out"
    )


class Wiring:
    """Keeps ``nbytes`` (pools + staging) wired while open: raises MLX's wired limit to cover
    them (at most the recommended working set; never lowers it) and puts the old limit back at
    ``close()``. Does nothing where there is no working set, or for nothing to wire."""

    def __init__(self, nbytes: int, memory: Optional[MetalMemory] = None):
        self.memory = memory or MetalMemory()
        self.nbytes = nbytes
        self.previous: Optional[int] = None
        self.limit: Optional[int] = None
        ws = self.memory.working_set() if nbytes > 0 else None
        if not ws:
            return
        try:
            current = self.memory.set_wired_limit(0)
            want = max(current, min(ws, nbytes))
            self.memory.set_wired_limit(want)
        except Exception as e:  # noqa: BLE001 - e.g. macOS < 15: wiring is a speed-up, not a need
            log.info("could not wire the expert slots: %s", e)
            return
        self.previous, self.limit = current, want
        if nbytes > ws:
            log.warning(
                "expert slots and staging (%.2f GB) exceed the recommended working set "
                "(%.2f GB): only part of them can be kept resident",
                nbytes / 1e9,
                ws / 1e9,
            )
        else:
            log.info("wired limit %.2f GB: the expert slots stay resident", want / 1e9)

    @property
    def wired(self) -> bool:
        return self.limit is not None

    def close(self) -> None:
        if self.previous is not None:
            previous, self.previous = self.previous, None
            try:
                mx.synchronize()  # no pending work while the limit changes (as mlx-lm does)
                self.memory.set_wired_limit(previous)
            except Exception as e:  # noqa: BLE001 - closing must not fail over this
                log.info("could not restore the wired limit: %s", e)
