"""The device-side slot table: decode without a host sync per MoE layer (CUDA).

With a host sync per layer the GPU idles while Python builds each layer's graph, and Python idles
while the GPU runs it (0.6-0.7 ms per layer on an H100, see benchmarks/results). Here the
expert -> slot table of each partially cached layer lives in a control block of host-resident
memory that the GPU reads in place (``upload.host_staging``), and each decode call enqueues:

- ``resolve`` (one block): looks the router's experts up in the table. All resident: it writes
  their slots and the host never hears of it. A miss: it publishes the request in the control
  block and waits, on the GPU, for the host thread (``MissService``) to read the missing experts
  into host-resident staging, pick victims (LRU) and update the table; then it reads the table
  again.
- ``fill``: copies what the host read from the staging into the victims' pool slots.
- the expert kernels (backends), on those slots.

So a token's whole graph is built and enqueued at once, as mlx-lm does for stock models, and only
the GPU waits, only on misses (a round trip of about 60-80 us on an H100,
benchmarks/wait_probe.py). Decode-sized calls (one token) take this path; prefill keeps the
synced one (``cache.ExpertCache.fetch``), which works on the same table.

Control block (int32 words, pinned host memory, like the staging): four vectors with one word per table layer -- request and answer
sequence numbers (the host polls these), GPU faults, and the LRU clock (calls so far) -- then per
layer a header (``H_*``), the table (expert -> slot, -1 absent), the clock value of each slot's
last use (-1 free), the request's experts and the copy list (staging row -> slot).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import mlx.core as mx
import numpy as np

from .errors import DeviceWaitError, ExpertReadError
from .kernels import load_source
from .layout import ExpertLayout
from .upload import PinnedBuffer, cuda_runtime_available

log = logging.getLogger(__name__)

H_ERR, H_NREQ, H_NCOPY, H_WAITS, H_WAIT_US = range(5)  # per-layer header words
HEADER_WORDS = 8
FAULT_INDEX, FAULT_TIMEOUT = 1, 2
MAX_SELECTIONS = 64  # routed experts per call the table path serves (top-k of one token)
# how long the GPU waits for the host before it gives up (DeviceWaitError)
WAIT_TIMEOUT_S = float(os.environ.get("MOEFLUX_WAIT_TIMEOUT_S", "60"))
FILL_BLOCKS, FILL_THREADS = 132, 256
POLL_SLEEP_S = 20e-6  # the service's pause between polls while GPU work is in flight
IDLE_WAIT_S = 0.01  # ... and when none is
STALL_S = 1.0  # in flight this long without progress: treated as idle (a graph never evaluated)


def available() -> bool:
    return (hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu
            and cuda_runtime_available())


def enabled(requested: Optional[bool] = None) -> bool:
    """Whether decode should use the device-side table. Opt-in (``requested`` or
    ``MOEFLUX_DEVICE_TABLE=1``) while it is experimental: on the H100 some runs stalled with a
    request the miss service never answered (README, "Known problems"). Needs CUDA."""
    if requested is None:
        env = os.environ.get("MOEFLUX_DEVICE_TABLE", "").strip().lower()
        requested = env in ("1", "on", "true")
    if requested and not available():
        log.warning("device-side slot table requested, but it needs MLX's CUDA backend and "
                    "libcudart: using a host sync per layer")
        return False
    return bool(requested)


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


META_CTRL, META_STAGING = 11, 13  # where meta holds the two addresses (lo, hi words)


@dataclass
class TableLayer:
    """One layer's part of the control block; the arrays are views into it."""

    index: int  # its word in the four per-layer vectors
    offsets: list  # meta[0:11]: see ControlBlock.meta
    num_experts: int
    n_slots: int
    header: np.ndarray
    slot_of: np.ndarray  # expert -> slot, -1: absent
    last_used: np.ndarray  # slot -> clock value of its last use, -1: free
    request: np.ndarray  # experts of the pending request
    copy_src: np.ndarray  # staging row ...
    copy_dst: np.ndarray  # ... -> slot, for the next fill
    meta: Optional[mx.array] = None
    launches: dict = field(default_factory=dict)  # experts per call -> _Launches


class ControlBlock:
    """Words shared by the host and the resolve/fill kernels of every table layer, in pinned
    host memory mapped for the GPU (``upload.PinnedBuffer``)."""

    def __init__(self, layers: Dict[int, tuple]):
        """``layers``: layer -> (num_experts, n_slots)."""
        order = sorted(layers)
        nl = len(order)
        flags = _round(4 * nl, 16)
        offsets, size = {}, flags
        for layer in order:
            e, s = layers[layer]
            offsets[layer] = size
            size += _round(HEADER_WORDS + e + s + 3 * MAX_SELECTIONS, 16)
        self.buffer = PinnedBuffer(size * 4)
        self.words = self.buffer.array.view(np.int32)
        self.order = order
        self.requests, self.answers = self.words[0:nl], self.words[nl:2 * nl]
        self.faults, self.ticks = self.words[2 * nl:3 * nl], self.words[3 * nl:4 * nl]
        self.layers: Dict[int, TableLayer] = {}
        self.staging: Dict[int, PinnedBuffer] = {}  # blob size -> rows of one call's misses
        for i, layer in enumerate(order):
            e, s = layers[layer]
            b = offsets[layer]
            tab = b + HEADER_WORDS
            last = tab + e
            reqi = last + s
            csrc = reqi + MAX_SELECTIONS
            cdst = csrc + MAX_SELECTIONS
            w = self.words
            w[tab:tab + e + s] = -1
            self.layers[layer] = TableLayer(
                i, [i, nl + i, b, tab, last, reqi, csrc, cdst, e, 2 * nl + i, 3 * nl + i], e, s,
                w[b:b + HEADER_WORDS], w[tab:tab + e], w[last:last + s],
                w[reqi:reqi + MAX_SELECTIONS], w[csrc:csrc + MAX_SELECTIONS],
                w[cdst:cdst + MAX_SELECTIONS])

    def staging_for(self, blob_size: int, rows: int) -> np.ndarray:
        """``[rows, blob_size]`` pinned staging for one call's misses, shared by the layers of
        that blob size (a layer's fill has run before the next layer's request is served)."""
        buf = self.staging.get(blob_size)
        if buf is None:
            buf = self.staging[blob_size] = PinnedBuffer(rows * blob_size)
        return buf.array.reshape(-1, blob_size)

    def meta(self, layer: int, blob_size: int) -> mx.array:
        """The kernels' view of a layer: its offsets in the control block (resolve_cuda.cuh reads
        them by position), then the control block's and the staging's device addresses."""
        t = self.layers[layer]
        if t.meta is None:
            words = list(t.offsets)
            for ptr in (self.buffer.device_ptr, self.staging[blob_size].device_ptr):
                words += [ptr & 0xFFFFFFFF, ptr >> 32]
            t.meta = mx.array(np.array(words, np.uint32).view(np.int32))
            mx.eval(t.meta)
        return t.meta

    def close(self) -> None:
        for buf in self.staging.values():
            buf.close()
        self.buffer.close()

    def pending(self) -> np.ndarray:
        """Table-layer positions with a request not yet answered."""
        return np.flatnonzero(self.requests != self.answers)

    def fault(self) -> Optional[str]:
        bad = np.flatnonzero(self.faults)
        if not bad.size:
            return None
        i = int(bad[0])
        layer = self.order[i]
        if self.faults[i] == FAULT_INDEX:
            return (f"layer {layer}: the router asked for an expert index out of range (the "
                    f"layer has {self.layers[layer].num_experts} experts)")
        return (f"layer {layer}: the GPU waited more than {WAIT_TIMEOUT_S:.0f} s for the host "
                "to read missed experts and gave up (was the miss service thread stopped?)")


# ---------------------------------------------------------------------------------------------
# Kernels (CUDA only: the GPU waits on host memory; Metal keeps the synced path)


def _defines(**values) -> str:
    return "".join(f"#define MF_{k} {v}\n" for k, v in values.items())


@functools.lru_cache(maxsize=None)
def _header() -> str:
    return (load_source("prelude_cuda.cuh") + "\n" + load_source("table_cuda.cuh") + "\n"
            + _defines(H_ERR=H_ERR, H_NREQ=H_NREQ, H_NCOPY=H_NCOPY, H_WAITS=H_WAITS,
                       H_WAIT_US=H_WAIT_US, FAULT_INDEX=FAULT_INDEX, FAULT_TIMEOUT=FAULT_TIMEOUT,
                       MAXN=MAX_SELECTIONS, WAIT_TIMEOUT_NS=f"{int(WAIT_TIMEOUT_S * 1e9)}ull",
                       META_CTRL=META_CTRL, META_STAGING=META_STAGING))


def _named(kind: str, header: str, body: str) -> str:
    return f"moeflux_{kind}_{hashlib.sha1((header + body).encode()).hexdigest()[:10]}"


@functools.lru_cache(maxsize=None)
def _resolve_kernel():
    header, body = _header(), load_source("resolve_cuda.cuh")
    return mx.fast.cuda_kernel(name=_named("resolve", header, body), input_names=["inds", "meta"],
                               output_names=["slots"], source=body, header=header)


@functools.lru_cache(maxsize=None)
def _fill_kernel(blob_size: int, components: tuple):
    """One fill kernel per expert layout: the component offsets and sizes
    (``components``: ``(offset, nbytes)`` each) are compiled in."""
    copies = "".join(
        f"    mf_copy_component<{nbytes}ll>(s + {offset}, const_cast<uint8_t*>(p{i}) + d * "
        f"{nbytes}ll, poison, gtid, gsize);\n" for i, (offset, nbytes) in enumerate(components))
    header = _header() + _defines(BLOB=f"{blob_size}ll")
    body = load_source("fill_cuda.cuh").replace("MF_COPY_COMPONENTS", copies)
    return mx.fast.cuda_kernel(
        name=_named("fill", header, body),
        input_names=["slots", "meta", *[f"p{i}" for i in range(len(components))]],
        output_names=["out_slots"], source=body, header=header)


@dataclass
class _Launches:
    """A layer's resolve and fill launches for calls of ``n`` experts, worked out once: decode
    makes them once per layer and token."""

    meta: mx.array
    fill: object
    resolve_kwargs: dict
    fill_kwargs: dict

    @classmethod
    def make(cls, control: ControlBlock, layer: int, layout: ExpertLayout, n: int) -> "_Launches":
        threads = _round(max(n, 1), 32)
        comps = tuple((c.offset, c.nbytes) for c in layout.components)
        return cls(control.meta(layer, layout.blob_size), _fill_kernel(layout.blob_size, comps),
                   dict(template=[("N", n)], grid=(threads, 1, 1), threadgroup=(threads, 1, 1),
                        output_shapes=[(n,)], output_dtypes=[mx.uint32]),
                   dict(template=[("N", n)], grid=(FILL_BLOCKS * FILL_THREADS, 1, 1),
                        threadgroup=(FILL_THREADS, 1, 1), output_shapes=[(n,)],
                        output_dtypes=[mx.uint32]))


def resolve(control: ControlBlock, layer: int, indices: mx.array, raw: Dict[str, mx.array],
            layout: ExpertLayout) -> mx.array:
    """Lazy slots for ``indices`` (one token's experts), made resident on the way (see above).
    The layer's staging (``control.staging_for``) must exist."""
    t = control.layers[layer]
    n = indices.size
    launch = t.launches.get(n)
    if launch is None:
        launch = t.launches[n] = _Launches.make(control, layer, layout, n)
    inds = indices.reshape(-1)
    if inds.dtype != mx.uint32:
        inds = inds.astype(mx.uint32)
    slots = _resolve_kernel()(inputs=[inds, launch.meta], **launch.resolve_kwargs)[0]
    pools = [raw[c.name] for c in layout.components]
    filled = launch.fill(inputs=[slots, launch.meta, *pools], **launch.fill_kwargs)[0]
    return filled.reshape(indices.shape)


# ---------------------------------------------------------------------------------------------
# The host side


class MissService:
    """The host thread that answers the GPU's miss requests.

    ``serve(layer, experts)`` (the cache's) reads the missing ones into staging, updates the
    table and the copy list, and raises on a failed read; the request is answered either way, so
    the GPU never waits for an error. Errors are kept and raised by ``check()`` on the next
    module call. ``poll()`` may also be called from the main thread (the streaming module does,
    while it builds the next token's graph and the GPU may be waiting on this one)."""

    def __init__(self, control: ControlBlock, serve: Callable[[int, np.ndarray], None]):
        self.control, self.serve = control, serve
        self.expected = np.zeros(len(control.order), np.int64)  # calls enqueued per layer
        self.errors: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._work = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeflux-miss-service", daemon=True)
        self._thread.start()

    def enqueued(self, layer: int) -> None:
        self.expected[self.control.layers[layer].index] += 1
        self._work.set()

    def poll(self) -> bool:
        """Answer every pending request; False when there was none (or another thread is on it)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            pending = self.control.pending()
            for i in pending:
                self._answer(int(i))
            return bool(pending.size)
        finally:
            self._lock.release()

    def _answer(self, i: int) -> None:
        c = self.control
        layer = c.order[i]
        t = c.layers[layer]
        experts = np.unique(t.request[:int(t.header[H_NREQ])])
        try:
            self.serve(layer, experts)
        except BaseException as e:  # kept for check(); the GPU goes on with poisoned slots
            log.error("layer %d: reading experts %s failed: %s", layer, experts.tolist(), e)
            self.errors.append(e)
        finally:
            c.answers[i] = c.requests[i]

    def in_flight(self) -> bool:
        return bool((self.control.ticks != self.expected).any())

    def _run(self) -> None:
        last_ticks, last_change = None, time.monotonic()
        while not self._stop.is_set():
            if self.poll():
                last_change = time.monotonic()
                continue
            ticks = self.control.ticks.copy()
            if last_ticks is None or (ticks != last_ticks).any():
                last_ticks, last_change = ticks, time.monotonic()
            if self.in_flight() and time.monotonic() - last_change < STALL_S:
                time.sleep(POLL_SLEEP_S)
            else:
                self._work.wait(IDLE_WAIT_S)
                self._work.clear()

    def check(self) -> None:
        """Raise what went wrong since the last check (a failed read, a GPU fault)."""
        fault = self.control.fault()
        if fault is not None:
            c = self.control
            state = (f" [requests {c.requests.tolist()}, answers {c.answers.tolist()}, service "
                     f"thread {'alive' if self._thread.is_alive() else 'stopped'}]")
            raise DeviceWaitError(fault + "; load the model again" + state)
        if self.errors:
            errors, self.errors = self.errors, []
            first = errors[0]
            if isinstance(first, ExpertReadError):
                raise first
            raise ExpertReadError(f"reading missed experts failed: {first}") from first

    def close(self) -> None:
        """Stop the thread once the GPU no longer needs it."""
        if self._thread.is_alive():
            try:
                mx.synchronize()  # any wait still enqueued is answered first
            finally:
                self._stop.set()
                self._work.set()
                self._thread.join(timeout=5)
        self.control.close()


def staging_rows(top_k: int) -> int:
    return max(1, min(top_k, MAX_SELECTIONS))


def fits(n_selected: int, n_slots: int) -> bool:
    """Whether a call routing ``n_selected`` experts can take the table path on a layer with
    ``n_slots`` slots (it needs a slot for each, and staging is sized for one token)."""
    return 0 < n_selected <= min(MAX_SELECTIONS, n_slots)

