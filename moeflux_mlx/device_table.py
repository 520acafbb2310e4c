"""The device-side slot table: decode without a host sync per MoE layer (CUDA).

With a host sync per layer the GPU idles while Python builds each layer's graph, and Python idles
while the GPU runs it (0.6-0.8 ms per layer on an H100, see benchmarks/results). Here the
expert -> slot table of each partially cached layer lives in a control block of shared memory
that the GPU reads in place (``control_block.py``), and each decode call enqueues:

- ``resolve`` (one block): looks the router's experts up in the table. All resident: it writes
  their slots and the host never hears of it. A miss: it publishes the request in the control
  block and waits, on the GPU, for the miss server to read the missing experts into the
  staging, pick victims (LRU) and update the table; then it reads the table again.
- ``fill``: copies what the server read from the staging into the victims' pool slots.
- the expert kernels (backends), on those slots.

So a token's whole graph is built and enqueued at once, as mlx-lm does for stock models, and only
the GPU waits, only on misses. Decode-sized calls (one token) take this path; prefill keeps the
synced one (``cache.ExpertCache.fetch``), which asks the server to admit experts into the same
table (a host request) and writes them itself.

The miss server is a helper process (``miss_server.py``): a thread of this process cannot be
relied on to answer, because MLX can block this process's thread inside ``mx.async_eval`` while
holding the GIL (benchmarks/table_stall_probe.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from .control_block import (FAULT_INDEX, FAULT_TIMEOUT, G_ERRORS, G_PENDING_RELEASE, G_READY,
                            G_STOP, H_ERR, H_HINT_N, H_HOST_KIND, H_HOST_N, H_HOST_NMISS,
                            H_HOST_TICKS, H_NCOPY, H_NREQ, H_WAIT_US, H_WAITS, MAX_SELECTIONS,
                            META_CTRL, META_HINT, META_STAGING, S_BYTES, S_IO_NS, S_MISSED,
                            S_PF_HITS, S_PF_ISSUED, S_READ, ControlBlock)
from .errors import DeviceWaitError, ExpertReadError
from .kernels import load_source
from .layout import ExpertLayout
from .counters import LayerStats
from .upload import PinnedBuffer, cuda_runtime_available

log = logging.getLogger(__name__)

# how long the GPU waits for the miss server before it gives up (DeviceWaitError)
WAIT_TIMEOUT_S = float(os.environ.get("MOEFLUX_WAIT_TIMEOUT_S", "60"))
SERVER_START_S = 60.0  # the miss server must be up by then
HOST_WAIT_S = 60.0  # a host request must be answered by then
FILL_BLOCKS, FILL_THREADS = 132, 256


def available() -> bool:
    return (hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu
            and cuda_runtime_available())


def enabled(requested=None) -> bool:
    """Whether decode should use the device-side table: ``requested`` (True, False, "all"), else
    ``MOEFLUX_DEVICE_TABLE=0|1``, else wherever it can run (MLX's CUDA backend and libcudart)."""
    if requested is None:
        env = os.environ.get("MOEFLUX_DEVICE_TABLE", "").strip().lower()
        if env in ("0", "off", "false"):
            return False
        requested = True if env in ("1", "on", "true") else None
    if requested is None:
        return available()
    if requested and not available():
        log.warning("device-side slot table requested, but it needs MLX's CUDA backend and "
                    "libcudart: using a host sync per layer")
        return False
    return bool(requested)


def make_control(layers: Dict[int, tuple]) -> ControlBlock:
    """A control block in pinned shared memory, mapped for the GPU."""
    return ControlBlock(layers, allocate=PinnedBuffer)


def _meta(control: ControlBlock, staging: PinnedBuffer, layer: int) -> mx.array:
    """``_make_meta``, made once per layer."""
    launches = control.layers[layer].launches
    if "meta" not in launches:
        launches["meta"] = _make_meta(control, staging, layer)
    return launches["meta"]


def _make_meta(control: ControlBlock, staging: PinnedBuffer, layer: int) -> mx.array:
    """The kernels' view of a layer: its offsets in the control block (resolve_cuda.cuh reads
    them by position), the control block's and the staging's device addresses, then where its
    hint goes (hint_cuda.cuh)."""
    t = control.layers[layer]
    words = list(t.offsets)
    for ptr in (control.buffer.device_ptr, staging.device_ptr):
        words += [ptr & 0xFFFFFFFF, ptr >> 32]
    words += list(t.hint_offsets)
    meta = mx.array(np.array(words, np.uint32).view(np.int32))
    mx.eval(meta)
    return meta


# ---------------------------------------------------------------------------------------------
# Kernels (CUDA only: the GPU waits on host memory; Metal keeps the synced path)


def _defines(**values) -> str:
    return "".join(f"#define MF_{k} {v}\n" for k, v in values.items())


@functools.lru_cache(maxsize=None)
def _header() -> str:
    return (load_source("prelude_cuda.cuh") + "\n" + load_source("moe_common.h") + "\n"
            + load_source("table_cuda.cuh") + "\n"
            + _defines(H_ERR=H_ERR, H_NREQ=H_NREQ, H_NCOPY=H_NCOPY, H_WAITS=H_WAITS,
                       H_WAIT_US=H_WAIT_US, H_HOST_TICKS=H_HOST_TICKS, H_HINT_N=H_HINT_N,
                       FAULT_INDEX=FAULT_INDEX, FAULT_TIMEOUT=FAULT_TIMEOUT,
                       MAXN=MAX_SELECTIONS, WAIT_TIMEOUT_NS=f"{int(WAIT_TIMEOUT_S * 1e9)}ull",
                       META_CTRL=META_CTRL, META_STAGING=META_STAGING, META_HINT=META_HINT))


def _named(kind: str, header: str, body: str) -> str:
    return f"moeflux_{kind}_{hashlib.sha1((header + body).encode()).hexdigest()[:10]}"


@functools.lru_cache(maxsize=None)
def _hint_kernel():
    header, body = _header(), load_source("hint_cuda.cuh")
    return mx.fast.cuda_kernel(name=_named("hint", header, body),
                               input_names=["inds", "pred", "meta"], output_names=["out"],
                               source=body, header=header)


@functools.lru_cache(maxsize=None)
def _resolve_kernel():
    header, body = _header(), load_source("resolve_cuda.cuh")
    return mx.fast.cuda_kernel(name=_named("resolve", header, body),
                               input_names=["inds", "meta", "after"], output_names=["slots"],
                               source=body, header=header)


def _components(layout: ExpertLayout) -> tuple:
    """``(offset, nbytes)`` of each expert component: what a copy kernel compiles in."""
    return tuple((c.offset, c.nbytes) for c in layout.components)


def _warps(n: int) -> int:
    """Threads for a one-block kernel of ``n`` lanes: whole warps."""
    return (max(n, 1) + 31) // 32 * 32


def _flat_u32(a: mx.array) -> mx.array:
    a = a.reshape(-1)
    return a if a.dtype == mx.uint32 else a.astype(mx.uint32)


def _index_array(a: mx.array) -> mx.array:
    """Router indices as resolve reads them (through their strides): no graph node unless the
    dtype is neither uint32 nor int32."""
    return a if a.dtype in (mx.uint32, mx.int32) else a.astype(mx.uint32)


COPY_GRID = dict(grid=(FILL_BLOCKS * FILL_THREADS, 1, 1), threadgroup=(FILL_THREADS, 1, 1))


def _copy_kernel(kind: str, first_inputs: list, output: str, blob_size: int, components: tuple):
    """A kernel copying expert blobs into pool slots (``fill_cuda.cuh``, ``write_cuda.cuh``), one
    per expert layout: the component offsets and sizes (``(offset, nbytes)`` each) are
    compiled in."""
    copies = "".join(
        f"    mf_copy_component<{nbytes}ll>(s + {offset}, const_cast<uint8_t*>(p{i}) + d * "
        f"{nbytes}ll, poison, gtid, gsize);\n" for i, (offset, nbytes) in enumerate(components))
    header = _header() + _defines(BLOB=f"{blob_size}ll")
    body = load_source(f"{kind}_cuda.cuh").replace("MF_COPY_COMPONENTS", copies)
    return mx.fast.cuda_kernel(
        name=_named(kind, header, body),
        input_names=[*first_inputs, *[f"p{i}" for i in range(len(components))]],
        output_names=[output], source=body, header=header)


@functools.lru_cache(maxsize=None)
def _fill_kernel(blob_size: int, components: tuple):
    return _copy_kernel("fill", ["slots", "meta"], "out_slots", blob_size, components)


@functools.lru_cache(maxsize=None)
def _write_kernel(blob_size: int, components: tuple):
    return _copy_kernel("write", ["blobs", "dst"], "done", blob_size, components)


def write_in_place(blobs: mx.array, slots: np.ndarray, raw: Dict[str, mx.array],
                   layout: ExpertLayout) -> mx.array:
    """Copy ``blobs`` ``[n, blob_size]`` into the pool arrays ``raw`` at ``slots``, in place
    (see write_cuda.cuh for why a table layer needs that); lazy: evaluate what it returns."""
    kernel = _write_kernel(layout.blob_size, _components(layout))
    dst = mx.array(np.asarray(slots, np.uint32))
    return kernel(inputs=[blobs, dst, *[raw[c.name] for c in layout.components]], **COPY_GRID,
                  output_shapes=[(1,)], output_dtypes=[mx.uint32])[0]


@dataclass
class _Launches:
    """A layer's resolve and fill launches for calls of ``n`` experts, worked out once: decode
    makes them once per layer and token."""

    meta: mx.array
    fill: object
    resolve_kwargs: dict
    fill_kwargs: dict

    @classmethod
    def make(cls, control: ControlBlock, staging: PinnedBuffer, layer: int, layout: ExpertLayout,
             indices: mx.array, after: mx.array) -> "_Launches":
        n = indices.size
        threads = _warps(n)
        # resolve's output carries one more word: the call's request number (0: all resident),
        # which tells fill whether the copy list is this call's. The input dtypes are template
        # arguments only to tell MLX's kernel cache (by name) one signature from another.
        return cls(_meta(control, staging, layer),
                   _fill_kernel(layout.blob_size, _components(layout)),
                   dict(template=[("N", n), ("IDX", indices.dtype), ("AFTER", after.dtype)],
                        grid=(threads, 1, 1), threadgroup=(threads, 1, 1),
                        output_shapes=[(n + 1,)], output_dtypes=[mx.uint32]),
                   dict(template=[("N", n)], **COPY_GRID, output_shapes=[tuple(indices.shape)],
                        output_dtypes=[mx.uint32]))


def hint(control: ControlBlock, staging: PinnedBuffer, layer: int, indices: mx.array,
         predicted: mx.array) -> mx.array:
    """``indices`` passed on (lazy), once ``predicted`` (the experts the router of ``layer``, the
    next table layer, is predicted to pick) is published for the miss server to read ahead."""
    n, k = indices.size, predicted.size
    kwargs = control.layers[layer].launches.get(("hint", n, k))
    if kwargs is None:
        threads = _warps(max(n, k))
        kwargs = control.layers[layer].launches[("hint", n, k)] = dict(
            template=[("N", n), ("K", k)], grid=(threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[(n,)], output_dtypes=[mx.uint32])
    out = _hint_kernel()(inputs=[_flat_u32(indices), _flat_u32(predicted),
                                 _meta(control, staging, layer)], **kwargs)[0]
    return out.reshape(indices.shape)


def resolve(control: ControlBlock, staging: PinnedBuffer, layer: int, indices: mx.array,
            raw: Dict[str, mx.array], layout: ExpertLayout,
            after: Optional[mx.array] = None) -> mx.array:
    """Lazy slots for ``indices`` (one token's experts), made resident on the way (see above).
    ``staging``: where the miss server reads this layout's missed experts. ``after``: the
    previous table call's expert computation, which the lookup must not overtake. MLX's CUDA
    backend runs a graph's kernels concurrently unless one reads a buffer another wrote, and
    these kernels' effects (the table, the staging, the pool) are invisible to it: graphs
    evaluated together (forward passes built, then evaluated at once) would interleave, a
    later call's misses evicting slots an earlier one has yet to read. An input of the lookup
    is an edge. Within one forward pass, and from token to token, the order is implied anyway."""
    t = control.layers[layer]
    indices = _index_array(indices)
    if after is None:
        after = _meta(control, staging, layer)
    key = (tuple(indices.shape), indices.dtype, after.dtype)
    launch = t.launches.get(key)
    if launch is None:
        launch = t.launches[key] = _Launches.make(control, staging, layer, layout, indices, after)
    # two graph nodes (decode is host-bound, docs/kernels.md): indices and after go in as they
    # are, and fill's output is declared in the router's shape
    slots = _resolve_kernel()(inputs=[indices, launch.meta, after], **launch.resolve_kwargs)[0]
    pools = [raw[c.name] for c in layout.components]
    return launch.fill(inputs=[slots, launch.meta, *pools], **launch.fill_kwargs)[0]


# ---------------------------------------------------------------------------------------------
# The model process's side of the miss server


class MissServer:
    """Starts the miss server process for a control block and talks to it.

    ``store``: the ``ExpertStore`` whose files it opens again (``store.spec()``)."""

    def __init__(self, control: ControlBlock, store, prefetch: bool = False):
        self.control = control
        self.prefetch = prefetch
        self.staging: Dict[int, PinnedBuffer] = {}  # blob size -> rows of one call's misses
        self._errors_seen = 0
        self._folded = {layer: np.zeros_like(t.stats) for layer, t in control.layers.items()}
        self._waits_folded = {layer: (0, 0) for layer in control.layers}
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._stderr = tempfile.TemporaryFile()
        spec = {"layers": {str(k): v for k, v in control.spec.items()}, "control_fd": control.fd,
                "socket_fd": child.fileno(), "store": store.spec(), "prefetch": prefetch}
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)  # works from a source checkout too
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        try:
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "moeflux_mlx.miss_server"], stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, stderr=self._stderr, env=env,
                    pass_fds=(control.fd, child.fileno()))
            finally:
                child.close()
            self.proc.stdin.write(json.dumps(spec).encode())
            self.proc.stdin.close()
            deadline = time.monotonic() + SERVER_START_S
            while not control.globals[G_READY]:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise DeviceWaitError(f"the miss server did not start within {SERVER_START_S:.0f} s")
                time.sleep(0.005)
        except BaseException:
            self.close()
            raise

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")[-2000:].strip()

    def _check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise DeviceWaitError(f"the miss server process exited (code {code}); load the model "
                                  f"again. Its last words: {self._stderr_tail() or '(none)'}")

    def staging_for(self, blob_size: int, rows: int) -> PinnedBuffer:
        """``[rows, blob_size]`` pinned staging for one call's misses, shared by the layers of
        that blob size (a layer's fill has run before the next layer's request is served)."""
        buf = self.staging.get(blob_size)
        if buf is None:
            buf = self.staging[blob_size] = PinnedBuffer(rows * blob_size)
            socket.send_fds(self._sock, [json.dumps({"blob_size": blob_size,
                                                     "nbytes": rows * blob_size}).encode()],
                            [buf.fd])
        return buf

    def enqueued(self, layer: int) -> None:
        """A table call of ``layer`` was enqueued: the GPU may ask soon."""
        self.control.expected[self.control.layers[layer].index] += 1

    def host_request(self, layer: int, kind: int, experts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Admit ``experts`` into the table (``HOST_ADMIT``: returns the missing ones and the
        slots they were given, for the caller to fill) or release them (``HOST_RELEASE``).
        Only while the GPU has no table call of this layer in flight (a synced call)."""
        self._check_alive()
        c = self.control
        t = c.layers[layer]
        i = t.index
        n = len(experts)
        t.host_request[:n] = experts
        t.header[H_HOST_N] = n
        t.header[H_HOST_KIND] = kind
        seq = int(c.host_answers[i]) + 1
        c.host_requests[i] = seq
        try:
            self._sock.send(b"w")  # wake it now rather than at its next idle poll
        except OSError:
            self._check_alive()
            raise
        deadline = time.monotonic() + HOST_WAIT_S
        while c.host_answers[i] != seq:
            self._check_alive()
            if time.monotonic() > deadline:
                raise DeviceWaitError(f"layer {layer}: the miss server did not answer within "
                                      f"{HOST_WAIT_S:.0f} s")
            time.sleep(20e-6)
        m = int(t.header[H_HOST_NMISS])
        return t.host_missing[:m].astype(np.int64), t.host_victims[:m].astype(np.int64)

    def check(self) -> None:
        """Raise what went wrong since the last check: a GPU fault, a failed read, the server
        gone."""
        c = self.control
        fault = c.fault()
        if fault is not None:
            raise DeviceWaitError(f"{fault} (MOEFLUX_WAIT_TIMEOUT_S={WAIT_TIMEOUT_S:g}); load the "
                                  "model again")
        errors = int(c.globals[G_ERRORS])
        if errors != self._errors_seen:
            self._errors_seen = errors
            deadline = time.monotonic() + 2.0  # the server frees the failed slots right away
            while c.globals[G_PENDING_RELEASE] and time.monotonic() < deadline:
                time.sleep(1e-4)
            raise ExpertReadError(c.get_message())
        self._check_alive()

    def fold_stats(self, stats_of) -> None:
        """Add what the server read for GPU requests, and the GPU's waits for it, since the
        last fold to ``stats_of(layer)`` (a ``LayerStats``)."""
        for layer, t in self.control.layers.items():
            now = t.stats.copy()
            d = now - self._folded[layer]
            waits = self.waits(layer)
            n_waits, wait_us = (a - b for a, b in zip(waits, self._waits_folded[layer]))
            if d.any() or n_waits:
                s: LayerStats = stats_of(layer)
                s.experts_missed += int(d[S_MISSED])
                s.experts_read += int(d[S_READ])
                s.bytes_read += int(d[S_BYTES])
                s.io_s += d[S_IO_NS] / 1e9
                s.gpu_waits += n_waits
                s.gpu_wait_s += wait_us / 1e6
                s.prefetch_issued += int(d[S_PF_ISSUED])
                s.prefetch_hits += int(d[S_PF_HITS])
            self._folded[layer] = now
            self._waits_folded[layer] = waits

    def waits(self, layer: int) -> Tuple[int, int]:
        """GPU waits of ``layer`` so far and their total in microseconds."""
        h = self.control.layers[layer].header
        return int(h[H_WAITS]), int(h[H_WAIT_US])

    def close(self) -> None:
        """Stop the server once the GPU no longer needs it; free the shared memory."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            try:
                mx.synchronize()  # any wait still enqueued is answered first
            finally:
                self.control.globals[G_STOP] = 1
                try:
                    self._sock.send(b"w")
                except OSError:
                    pass
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._sock.close()
        self._stderr.close()
        for buf in self.staging.values():
            buf.close()
        self.staging.clear()
        self.control.close()


def staging_rows(top_k: int) -> int:
    return max(1, min(top_k, MAX_SELECTIONS))


def fits(n_selected: int, n_slots: int) -> bool:
    """Whether a call routing ``n_selected`` experts can take the table path on a layer with
    ``n_slots`` slots (it needs a slot for each, and staging is sized for one token)."""
    return 0 < n_selected <= min(MAX_SELECTIONS, n_slots)
