"""The words the device-side slot table shares between the GPU, the model's process and the miss
server process (see table_kernels.py, miss_client.py and miss_server.py). Plain numpy: the miss server imports it
without MLX.

The block is one shared-memory mapping (``SharedMapping``: a memfd, or an unlinked file, mapped
MAP_SHARED) of int32 words, mapped by the model's process (which also registers it with CUDA so
kernels read it in place) and by the miss server:

- global words (``G_*``): stop, ready, read errors so far, releases pending;
- one word per table layer in each of eight vectors: GPU request and answer sequence numbers, GPU
  faults, calls done on the GPU (the LRU clock), calls enqueued by the host, host request and
  answer sequence numbers, and GPU hint sequence numbers (prefetch);
- per layer: a header (``H_*``), the table (expert -> slot, -1 absent), each slot's last use, the
  GPU request (its experts), the copy list for the next fill (staging row -> slot), the host
  request (its experts) and its answer (missing experts and the slots they get), and the GPU's
  hint (the experts the layer's router is predicted to pick next: the server reads them ahead);
- per layer, int64 counters of the server's GPU-request service (``S_*``);
- the last read error's message.

Who writes what: nobody writes a word another party writes (the GPU's stores to host memory
may land late and must not overwrite newer ones). The GPU writes the GPU requests, faults, its
call counts (``ticks``), the wait counters, the hints and ``last_used`` (each slot's last use by the GPU;
the server keeps its own and takes the later of the two); the model's process writes
``expected``, the host requests and ``stop``; the server writes everything else.

When the server may change a layer's table (``slot_of``): only while no GPU call of the layer
can be reading it. That is while the GPU waits for the server's answer to the layer's request,
on a host request (synced calls: none in flight), or, freeing the slots of a failed read, once
the call it last answered has ended (a call that asked nothing read its slots before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np

from .shared_memory import SharedMapping, round_up

# per-layer header words. The LRU clock of a layer is its calls so far: GPU calls (``ticks``)
# plus host admits (``H_HOST_TICKS``)
(
    H_ERR,
    H_NREQ,
    H_NCOPY,
    H_WAITS,
    H_WAIT_US,
    H_HOST_KIND,
    H_HOST_N,
    H_HOST_NMISS,
    H_HOST_TICKS,
    H_HINT_N,
    H_HINT_TICK,
    H_HOST_K,
) = range(12)
HEADER_WORDS = 12
# host request kinds: admit experts, release them, or teach the policy calls it did not serve
# (``H_HOST_N`` words, rows of ``H_HOST_K``: a prefill's routing)
HOST_ADMIT, HOST_RELEASE, HOST_OBSERVE = 1, 2, 3
OBSERVE_WORDS = 1024  # a host request's words: a prefill's latest 128 rows of top-8
G_STOP, G_READY, G_ERRORS, G_PENDING_RELEASE = range(4)
GLOBAL_WORDS = 16
VECTORS = (
    "requests",
    "answers",
    "faults",
    "ticks",
    "expected",
    "host_requests",
    "host_answers",
    "hints",
)
S_MISSED, S_READ, S_BYTES, S_IO_NS, S_PF_ISSUED, S_PF_HITS = range(6)
STAT_WORDS = 6
MESSAGE_BYTES = 4096
FAULT_INDEX, FAULT_TIMEOUT = 1, 2
MAX_SELECTIONS = 64  # routed experts per call the table path serves (top-k of one token)
META_CTRL, META_STAGING = 11, 13  # where the kernels' meta holds the two addresses (lo, hi words)
META_HINT = 15  # then the layer's hint sequence word and hint vector (TableLayer.hint_offsets)
META_SOURCES = 17  # then, with pinned files, each component's expert-0 address (lo, hi words)


@dataclass
class TableLayer:
    """One layer's part of the control block; the arrays are views into it."""

    index: int  # its word in the per-layer vectors
    offsets: list  # meta[0:11] for the kernels: see device_table._meta
    num_experts: int
    n_slots: int
    header: np.ndarray
    slot_of: np.ndarray  # expert -> slot, -1: absent
    last_used: np.ndarray  # slot -> clock value of its last use by the GPU (-1: none)
    request: np.ndarray  # experts of the pending GPU request
    copy_src: np.ndarray  # staging row ...
    copy_dst: np.ndarray  # ... -> slot, for the next fill
    host_request: np.ndarray  # experts of the pending host request
    host_missing: np.ndarray  # its answer: the experts that were not resident ...
    host_victims: np.ndarray  # ... and the slots they were given
    hint: np.ndarray  # experts predicted for the layer's next call (prefetch)
    hint_offsets: list  # meta[META_HINT:META_HINT + 2]: the hint's sequence word and vector
    stats: np.ndarray  # int64 S_* counters
    launches: dict = field(default_factory=dict)  # the model process's kernel launches
    # the model process's ``pinned_files.LayerSources`` when its misses are copied out of the
    # page-locked files (set before the layer's first kernel is made, never changed after)
    sources: Optional[object] = None


class ControlBlock:
    """The shared words of every table layer (see the module docstring)."""

    def __init__(self, layers: Dict[int, tuple], fd: Optional[int] = None, allocate=SharedMapping):
        """``layers``: layer -> (num_experts, n_slots). ``fd``: attach to an existing block, else
        a new one from ``allocate(nbytes)`` (a ``SharedMapping``; pinned for CUDA by the model
        process)."""
        self.spec = {int(k): (int(v[0]), int(v[1])) for k, v in layers.items()}
        order = sorted(self.spec)
        nl = len(order)
        size = round_up(GLOBAL_WORDS + len(VECTORS) * nl, 16)
        offsets = {}
        for layer in order:
            e, s = self.spec[layer]
            r = max(MAX_SELECTIONS, s)
            offsets[layer] = size
            size += round_up(HEADER_WORDS + e + s + 4 * MAX_SELECTIONS + 3 * r + OBSERVE_WORDS, 16)
        stats_at = round_up(size * 4, 8)
        message_at = stats_at + 8 * STAT_WORDS * nl
        nbytes = message_at + MESSAGE_BYTES
        self.buffer = allocate(nbytes) if fd is None else SharedMapping(nbytes, fd)
        self.words = self.buffer.array[: size * 4].view(np.int32)
        self.globals = self.words[:GLOBAL_WORDS]
        for k, name in enumerate(VECTORS):
            at = GLOBAL_WORDS + k * nl
            setattr(self, name, self.words[at : at + nl])
        self.message = self.buffer.array[message_at : message_at + MESSAGE_BYTES]
        stats = (
            self.buffer.array[stats_at:message_at].view(np.int64).reshape(max(nl, 1), STAT_WORDS)
        )
        self.order = order
        self.layers: Dict[int, TableLayer] = {}
        vec = {name: GLOBAL_WORDS + k * nl for k, name in enumerate(VECTORS)}
        w = self.words
        for i, layer in enumerate(order):
            e, s = self.spec[layer]
            r = max(MAX_SELECTIONS, s)
            b = offsets[layer]
            tab = b + HEADER_WORDS
            last = tab + e
            reqi = last + s
            csrc = reqi + MAX_SELECTIONS
            cdst = csrc + MAX_SELECTIONS
            hreq = cdst + MAX_SELECTIONS
            hmiss = hreq + r + OBSERVE_WORDS
            hvic = hmiss + r
            hint = hvic + r
            if self.buffer.owner:
                w[tab : tab + e + s] = -1
            self.layers[layer] = TableLayer(
                i,
                [
                    vec["requests"] + i,
                    vec["answers"] + i,
                    b,
                    tab,
                    last,
                    reqi,
                    csrc,
                    cdst,
                    e,
                    vec["faults"] + i,
                    vec["ticks"] + i,
                ],
                e,
                s,
                w[b : b + HEADER_WORDS],
                w[tab : tab + e],
                w[last : last + s],
                w[reqi : reqi + MAX_SELECTIONS],
                w[csrc : csrc + MAX_SELECTIONS],
                w[cdst : cdst + MAX_SELECTIONS],
                w[hreq : hreq + r + OBSERVE_WORDS],
                w[hmiss : hmiss + r],
                w[hvic : hvic + r],
                w[hint : hint + MAX_SELECTIONS],
                [vec["hints"] + i, hint],
                stats[i],
            )

    @property
    def fd(self) -> int:
        return self.buffer.fd

    def close(self) -> None:
        self.buffer.close()

    def pending(self) -> np.ndarray:
        """Table-layer positions with a GPU request not yet answered."""
        return np.flatnonzero(self.requests != self.answers)

    def host_pending(self) -> np.ndarray:
        return np.flatnonzero(self.host_requests != self.host_answers)

    def clock(self, i: int) -> int:
        """Table layer ``i``'s LRU clock: calls so far, GPU and host."""
        return int(self.ticks[i]) + int(self.layers[self.order[i]].header[H_HOST_TICKS])

    def in_flight(self) -> bool:
        """Whether table calls were enqueued that the GPU has not finished."""
        return bool((self.ticks != self.expected).any())

    def set_message(self, text: str) -> None:
        data = text.encode("utf-8", "replace")[: MESSAGE_BYTES - 1]
        self.message[: len(data)] = np.frombuffer(data, np.uint8)
        self.message[len(data)] = 0

    def get_message(self) -> str:
        raw = self.message.tobytes()
        return raw[: raw.find(b"\0") if b"\0" in raw else len(raw)].decode("utf-8", "replace")

    def fault(self) -> Optional[str]:
        bad = np.flatnonzero(self.faults)
        if not bad.size:
            return None
        i = int(bad[0])
        layer = self.order[i]
        if self.faults[i] == FAULT_INDEX:
            return (
                f"layer {layer}: the router asked for an expert index out of range (the "
                f"layer has {self.layers[layer].num_experts} experts)"
            )
        return (
            f"layer {layer}: the GPU waited too long for the miss server to read missed "
            "experts and gave up"
        )
