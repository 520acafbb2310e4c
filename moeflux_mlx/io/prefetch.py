"""Prefetch: read predicted experts in the background before the router asks for them.

Which experts to read is the model's business (``model.predict``); this module only reads them.
Predicted experts that are not resident are read by a thread pool into host buffers while the
device computes; the next layer's misses take those bytes instead of reading them again.
Prediction is set-based: order does not matter.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..stats import Stats
from .store import ExpertStore
from .uncached import aligned_empty

log = logging.getLogger(__name__)


class Prefetcher:
    """Reads blobs of predicted experts into host buffers; ``read`` consumes them."""

    def __init__(self, store: ExpertStore, stats: Stats, threads: int = 4):
        self.store, self.stats = store, stats
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="moeflux-prefetch")
        self._pending: Dict[Tuple[int, int], Future] = {}
        self._free: List[np.ndarray] = []

    def layout(self, layer: int):
        return self.store.layout(layer)

    def _buffer(self, layer: int) -> np.ndarray:
        size = self.store.layout(layer).blob_size
        while self._free:
            buf = self._free.pop()
            if buf.size == size:
                return buf
        return aligned_empty(size)  # whole pages: uncached reads go in place

    def submit(self, layer: int, experts: np.ndarray) -> None:
        self.store.check_experts(layer, experts)
        for e in experts.tolist():
            if (layer, e) not in self._pending:
                buf = self._buffer(layer)
                self._pending[(layer, e)] = self._pool.submit(_read_one, self.store, layer, e, buf)
                self.stats.layer(layer).prefetch_issued += 1

    def read(self, layer: int, experts: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Blobs of ``experts``: prefetched ones from their buffers, the rest from the store.

        A prefetch is a hint: one that failed is read again directly, so a lasting fault
        raises from that read, on the call that needed the expert, and a passing one is gone."""
        ready = {e: f for e in experts.tolist() if (f := self._pending.pop((layer, e), None))}
        self._discard(layer)  # predictions for this layer that the router did not pick
        if not ready:
            return self.store.read(layer, experts, out)
        st = self.stats.layer(layer)
        if out is None:
            out = np.empty((len(experts), self.store.layout(layer).blob_size), np.uint8)
        rest = []
        try:
            for i, e in enumerate(experts.tolist()):
                f = ready.pop(e, None)
                try:
                    buf = f.result() if f is not None else None
                except Exception as err:  # noqa: BLE001 - any failure: read it again below
                    log.debug(
                        "layer %d: prefetch of expert %d failed (%s); reading it again",
                        layer,
                        e,
                        err,
                    )
                    st.prefetch_failed += 1
                    buf = None
                if buf is None:
                    rest.append(i)
                    continue
                out[i] = buf
                self._free.append(buf)
                st.prefetch_hits += 1
        finally:
            for f in ready.values():
                f.cancel()
        if rest:
            out[rest] = self.store.read(layer, experts[rest])
        return out

    def _discard(self, layer: int) -> None:
        for key in [k for k in self._pending if k[0] == layer]:
            f = self._pending.pop(key)
            if not f.cancel() and f.done() and f.exception() is None:
                self._free.append(f.result())

    def close(self) -> None:
        for f in self._pending.values():
            f.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._free.clear()


def _read_one(store: ExpertStore, layer: int, e: int, buf: np.ndarray) -> np.ndarray:
    store.read_one(layer, e, buf)
    return buf
