"""The model process's side of the miss server (``miss_server.py``): starts the process for a
control block, hands it staging buffers, asks it to admit or release experts for synced calls,
and folds what it read into the model's counters."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..counters import LayerStats
from ..errors import DeviceWaitError, ExpertReadError
from ..io.store import ExpertStore
from .control_block import (
    HOST_OBSERVE,
    OBSERVE_WORDS,
    S_BYTES,
    S_IO_NS,
    S_MISSED,
    S_PF_HITS,
    S_PF_ISSUED,
    S_READ,
    ControlBlock,
)
from .runtime import PinnedBuffer

SERVER_START_S = 60.0  # the miss server must be up by then
HOST_WAIT_S = 60.0  # a host request must be answered by then


class MissServer:
    """Starts the miss server process for a control block and talks to it.

    ``store``: the ``ExpertStore`` whose files it opens again (``store.spec()``)."""

    def __init__(
        self,
        control: ControlBlock,
        store: ExpertStore,
        wait_timeout_s: float,
        poll_us: float,
        poll_max_us: float,
        eviction: str = "lru",
        in_place: Sequence[int] = (),
    ):
        self.control = control
        self.wait_timeout_s = wait_timeout_s
        self.staging: Dict[int, PinnedBuffer] = {}  # blob size -> rows of one call's misses
        self._errors_seen = 0
        self._folded = {layer: np.zeros_like(t.stats) for layer, t in control.layers.items()}
        self._waits_folded = {layer: (0, 0) for layer in control.layers}
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._stderr = tempfile.TemporaryFile()
        spec = {
            "layers": {str(k): v for k, v in control.spec.items()},
            "control_fd": control.fd,
            "socket_fd": child.fileno(),
            "store": store.spec(),
            "eviction": eviction,
            "poll_us": poll_us,
            "poll_max_us": poll_max_us,
            "in_place": [int(i) for i in in_place],  # layers whose misses the GPU copies itself
        }
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # works from a source checkout too
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        try:
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "moeflux_mlx.cuda.miss_server"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=self._stderr,
                    env=env,
                    pass_fds=(control.fd, child.fileno()),
                )
            finally:
                child.close()
            stdin = self.proc.stdin
            assert stdin is not None  # stdin=PIPE
            stdin.write(json.dumps(spec).encode())
            stdin.close()
            deadline = time.monotonic() + SERVER_START_S
            while not control.globals["ready"]:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise DeviceWaitError(
                        f"the miss server did not start within {SERVER_START_S:.0f} s"
                    )
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
            raise DeviceWaitError(
                f"the miss server process exited (code {code}); load the model "
                f"again. Its last words: {self._stderr_tail() or '(none)'}"
            )

    def staging_for(self, blob_size: int, rows: int) -> PinnedBuffer:
        """``[rows, blob_size]`` pinned staging for one call's misses, shared by the layers of
        that blob size (a layer's fill has run before the next layer's request is served)."""
        buf = self.staging.get(blob_size)
        if buf is None:
            buf = self.staging[blob_size] = PinnedBuffer(rows * blob_size)
            socket.send_fds(
                self._sock,
                [json.dumps({"blob_size": blob_size, "nbytes": rows * blob_size}).encode()],
                [buf.fd],
            )
        return buf

    def enqueued(self, layer: int) -> None:
        """A table call of ``layer`` was enqueued: the GPU may ask soon."""
        self.control.expected[self.control.layers[layer].index] += 1

    def host_request(
        self, layer: int, kind: int, experts: np.ndarray
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Admit ``experts`` into the table (``HOST_ADMIT``: returns the missing ones and the
        slots they were given, for the caller to fill) or release them (``HOST_RELEASE``).
        Only while the GPU has no table call of this layer in flight (a synced call)."""
        seq = self._post(layer, kind, np.asarray(experts).reshape(1, -1))
        self._answered(layer, seq)
        t = self.control.layers[layer]
        m = int(t.header["host_nmiss"])
        return t.host_missing[:m].astype(np.int64), t.host_victims[:m].astype(np.int64)

    def observe(self, layer: int, rows: np.ndarray) -> None:
        """Teach the layer's policy ``rows`` (``[n, top_k]``, calls it did not serve: a
        prefill's routing; the latest that fit a request), without waiting for the server:
        the GPU may run on meanwhile (nothing here changes a slot; the layer's clock moves on,
        which at most shifts the recency of a call in flight), and the layer's next host
        request waits for this one first."""
        rows = np.asarray(rows).reshape(len(rows), -1)
        rows = rows[-(OBSERVE_WORDS // max(rows.shape[1], 1)) :]
        if rows.size:
            self._post(layer, HOST_OBSERVE, rows)

    def _post(self, layer: int, kind: int, rows: np.ndarray) -> int:
        """Write a host request of ``rows`` (``[n, k]``) for the layer's server, once its
        previous one is answered; returns its sequence number."""
        self._check_alive()
        c = self.control
        t = c.layers[layer]
        i = t.index
        self._answered(layer, int(c.host_requests[i]))
        n = rows.size
        t.host_request[:n] = rows.reshape(-1)
        t.header["host_n"] = n
        t.header["host_k"] = rows.shape[1]
        t.header["host_kind"] = kind
        seq = int(c.host_answers[i]) + 1
        c.host_requests[i] = seq
        try:
            self._sock.send(b"w")  # wake it now rather than at its next idle poll
        except OSError:
            self._check_alive()
            raise
        return seq

    def _answered(self, layer: int, seq: int) -> None:
        """Wait until the server has answered the layer's host request ``seq``."""
        c = self.control
        i = c.layers[layer].index
        deadline = time.monotonic() + HOST_WAIT_S
        while c.host_answers[i] != seq:
            self._check_alive()
            if time.monotonic() > deadline:
                raise DeviceWaitError(
                    f"layer {layer}: the miss server did not answer within {HOST_WAIT_S:.0f} s"
                )
            time.sleep(20e-6)

    def check(self) -> None:
        """Raise what went wrong since the last check: a GPU fault, a failed read, the server
        gone."""
        c = self.control
        fault = c.fault()
        if fault is not None:
            raise DeviceWaitError(
                f"{fault} (it waits at most {self.wait_timeout_s:g} s); load the model again"
            )
        errors = int(c.globals["errors"])
        if errors != self._errors_seen:
            self._errors_seen = errors
            # the server frees the failed reads' slots once the GPU is past the calls that may
            # read them; raised after, so that a retry finds none of them poisoned
            deadline = time.monotonic() + HOST_WAIT_S
            while c.globals["pending_release"] and time.monotonic() < deadline:
                self._check_alive()
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
        return int(h["waits"]), int(h["wait_us"])

    def close(self) -> None:
        """Stop the server once the GPU no longer needs it; free the shared memory."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            try:
                mx.synchronize()  # any wait still enqueued is answered first
            finally:
                self.control.globals["stop"] = 1
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
