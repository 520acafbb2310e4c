"""The words the device-side slot table shares between the GPU, the model's process and the miss
server process (see table_kernels.py, miss_client.py and miss_server.py). Plain numpy: the miss server imports it
without MLX.

The block is one shared-memory mapping (``SharedMapping``: a memfd, or an unlinked file, mapped
MAP_SHARED) of int32 words, mapped by the model's process (which also registers it with CUDA so
kernels read it in place) and by the miss server:

- global words (``GLOBALS``): stop, ready, read errors so far, releases pending;
- one word per table layer in each of eight vectors: GPU request and answer sequence numbers, GPU
  faults, calls done on the GPU (the LRU clock), calls enqueued by the host, host request and
  answer sequence numbers, and GPU hint sequence numbers (a speculative pass's experts);
- per layer (``layer_dtype``): a header (``HEADER``), the table (expert -> slot, -1 absent),
  each slot's last use, the GPU request (its experts), the copy list for the next fill (staging
  row -> slot), the host request (its experts) and its answer (missing experts and the slots
  they get), and the GPU's hint (the experts the layer's router is predicted to pick next: the
  server reads them ahead);
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

The layout is a numpy structured dtype (``block_dtype``): every region is a named field at an
explicit byte offset, and the arrays below are views of those fields. The kernels see it only
as int32 word offsets, handed to them in ``meta`` (``META``, one named field per word they read
by position) and as the header's word indices (``H_*``, compiled in as ``MF_H_*``); both are
derived here from the dtypes. tests/test_device_table.py pins the offsets against the kernels'
text and against the layout as it was first laid out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .shared_memory import SharedMapping, round_up

if TYPE_CHECKING:  # the miss server imports this module without MLX
    from .pinned_files import LayerSources

WORD = 4  # bytes of an int32 word: the unit of every offset the kernels are given

# Per-layer header, int32 words. The LRU clock of a layer is its calls so far: GPU calls
# (``ticks``) plus host admits (``host_ticks``). Kernels index it by word (``H_*``, compiled in as
# ``MF_H_*``); Python reads it by name (``TableLayer.header["ncopy"]``).
HEADER = np.dtype(
    [
        ("err", "<i4"),  # the server's last answer failed to read (fill poisons the slots)
        ("nreq", "<i4"),  # experts in the GPU request
        ("ncopy", "<i4"),  # entries of the copy list
        ("waits", "<i4"),  # GPU waits for the server so far
        ("wait_us", "<i4"),  # ... and their total in microseconds
        ("host_kind", "<i4"),  # HOST_ADMIT, HOST_RELEASE or HOST_OBSERVE
        ("host_n", "<i4"),  # words of the host request
        ("host_nmiss", "<i4"),  # experts in the host answer
        ("host_ticks", "<i4"),  # host admits (calls) so far
        ("hint_n", "<i4"),  # experts in the hint
        ("hint_tick", "<i4"),  # the layer's GPU calls when the hint was published
        ("host_k", "<i4"),  # a host request's row length (HOST_OBSERVE)
    ]
)


def field_of(dtype: np.dtype, name: str) -> Tuple[np.dtype, int]:
    """``(dtype, byte offset)`` of the structured ``dtype``'s field ``name``."""
    fields = dtype.fields
    if fields is None or name not in fields:
        raise KeyError(f"{dtype} has no field {name!r}")
    sub, offset = fields[name][:2]
    return sub, offset


def _word(dtype: np.dtype, name: str) -> int:
    """The int32 word at which ``dtype``'s field ``name`` starts."""
    offset = field_of(dtype, name)[1]
    assert offset % WORD == 0, (name, offset)
    return offset // WORD


H_ERR = _word(HEADER, "err")
H_NREQ = _word(HEADER, "nreq")
H_NCOPY = _word(HEADER, "ncopy")
H_WAITS = _word(HEADER, "waits")
H_WAIT_US = _word(HEADER, "wait_us")
H_HOST_KIND = _word(HEADER, "host_kind")
H_HOST_N = _word(HEADER, "host_n")
H_HOST_NMISS = _word(HEADER, "host_nmiss")
H_HOST_TICKS = _word(HEADER, "host_ticks")
H_HINT_N = _word(HEADER, "hint_n")
H_HINT_TICK = _word(HEADER, "hint_tick")
H_HOST_K = _word(HEADER, "host_k")
HEADER_WORDS = HEADER.itemsize // WORD
# host request kinds: admit experts, release them, or teach the policy calls it did not serve
# (``host_n`` words, rows of ``host_k``: a prefill's routing)
HOST_ADMIT, HOST_RELEASE, HOST_OBSERVE = 1, 2, 3
OBSERVE_WORDS = 1024  # a host request's words: a prefill's latest 128 rows of top-8
GLOBAL_WORDS = 16
# the block's first words; the rest of its GLOBAL_WORDS are spare
GLOBALS = np.dtype(
    {
        "names": ["stop", "ready", "errors", "pending_release"],
        "formats": ["<i4"] * 4,
        "offsets": [0, 4, 8, 12],
        "itemsize": GLOBAL_WORDS * WORD,
    }
)
G_STOP = _word(GLOBALS, "stop")
G_READY = _word(GLOBALS, "ready")
G_ERRORS = _word(GLOBALS, "errors")
G_PENDING_RELEASE = _word(GLOBALS, "pending_release")
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
# per layer, int64, host-side only (the kernels never see them): indexed ``stats[S_*]``
STATS = ("missed", "read", "bytes", "io_ns", "pf_issued", "pf_hits")
S_MISSED, S_READ, S_BYTES, S_IO_NS, S_PF_ISSUED, S_PF_HITS = range(len(STATS))
STAT_WORDS = len(STATS)
MESSAGE_BYTES = 4096
FAULT_INDEX, FAULT_TIMEOUT = 1, 2
MAX_SELECTIONS = 64  # routed experts per call the table path serves (top-k of one token)

# The kernels' ``meta`` (int32 words, read by position: ``meta[3]`` is ``tab`` in
# resolve_cuda.cuh). Word offsets into the control block, the experts of the layer, and two
# addresses (lo, hi words: ``mf_ptr``). With pinned files each component's expert-0 address
# follows, from ``META_SOURCES``. The names are the kernels' own.
META = np.dtype(
    {
        "names": [
            "req_at",  # the layer's word in ``requests``
            "done_at",  # ... in ``answers``
            "base",  # its header
            "tab",  # its ``slot_of``
            "last",  # its ``last_used``
            "reqi",  # its ``request``
            "csrc",  # its ``copy_src``
            "cdst",  # its ``copy_dst``
            "n_experts",  # not an offset: the layer's experts
            "fault_at",  # the layer's word in ``faults``
            "tick_at",  # ... in ``ticks``
            "ctrl",  # the control block's device address
            "staging",  # the staging's device address
            "hseq",  # the layer's word in ``hints``
            "hint",  # its ``hint``
        ],
        "formats": ["<i4"] * 11 + ["<u8", "<u8", "<i4", "<i4"],
        "offsets": [WORD * k for k in range(11)] + [WORD * 11, WORD * 13, WORD * 15, WORD * 16],
        "itemsize": WORD * 17,
    }
)
META_CTRL = _word(META, "ctrl")
META_STAGING = _word(META, "staging")
META_HINT = _word(META, "hseq")  # then the hint vector's word (TableLayer.words.hint)
META_SOURCES = META.itemsize // WORD


def layer_dtype(num_experts: int, n_slots: int) -> np.dtype:
    """One table layer's region: int32 arrays, packed, padded to 16 words."""
    rows = max(MAX_SELECTIONS, n_slots)
    names_shapes = [
        ("header", HEADER, 1),
        ("slot_of", np.dtype("<i4"), num_experts),  # expert -> slot, -1: absent
        ("last_used", np.dtype("<i4"), n_slots),  # slot -> its last use by the GPU, -1: none
        ("request", np.dtype("<i4"), MAX_SELECTIONS),  # experts of the pending GPU request
        ("copy_src", np.dtype("<i4"), MAX_SELECTIONS),  # staging row (or expert, pinned) ...
        ("copy_dst", np.dtype("<i4"), MAX_SELECTIONS),  # ... -> slot, for the next fill
        ("host_request", np.dtype("<i4"), rows + OBSERVE_WORDS),  # the pending host request
        ("host_missing", np.dtype("<i4"), rows),  # its answer: the experts not resident ...
        ("host_victims", np.dtype("<i4"), rows),  # ... and the slots they were given
        ("hint", np.dtype("<i4"), MAX_SELECTIONS),  # experts predicted for the next call
    ]
    names: List[str] = []
    formats: List[object] = []
    offsets: List[int] = []
    at = 0
    for name, dt, n in names_shapes:
        names.append(name)
        formats.append(dt if name == "header" else (dt, (n,)))
        offsets.append(at)
        at += dt.itemsize * n
    return np.dtype(
        {
            "names": names,
            "formats": formats,
            "offsets": offsets,
            "itemsize": round_up(at, 16 * WORD),
        }
    )


def layer_field(layer: int) -> str:
    """The block's field of table layer ``layer``."""
    return f"layer{layer}"


def block_dtype(spec: Mapping[int, Tuple[int, int]]) -> np.dtype:
    """The whole control block for ``spec`` (layer -> (num_experts, n_slots)): the globals, the
    per-layer vectors (one int32 per table layer, in layer order), each layer's region, the
    int64 counters and the last error's message."""
    order = sorted(spec)
    nl = len(order)
    names: List[str] = ["globals"]
    formats: List[object] = [GLOBALS]  # a dtype, or (dtype, shape)
    offsets = [0]
    at = GLOBAL_WORDS * WORD
    for name in VECTORS:
        names.append(name)
        formats.append(("<i4", (nl,)))
        offsets.append(at)
        at += WORD * nl
    at = round_up(at, 16 * WORD)
    for layer in order:
        dt = layer_dtype(*spec[layer])
        names.append(layer_field(layer))
        formats.append(dt)
        offsets.append(at)
        at += dt.itemsize
    at = round_up(at, 8)  # the int64 counters (a no-op: the layers end on 64 bytes)
    names += ["stats", "message"]
    formats += [("<i8", (nl, STAT_WORDS)), ("u1", (MESSAGE_BYTES,))]
    offsets += [at, at + 8 * STAT_WORDS * nl]
    nbytes = at + 8 * STAT_WORDS * nl + MESSAGE_BYTES
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": nbytes})


@dataclass(frozen=True)
class LayerWords:
    """Where a table layer's words are, in int32 words from the block's start: what the
    kernels get in ``meta`` (``META``'s fields of the same names)."""

    req_at: int
    done_at: int
    base: int
    tab: int
    last: int
    reqi: int
    csrc: int
    cdst: int
    n_experts: int
    fault_at: int
    tick_at: int
    hseq: int
    hint: int

    @classmethod
    def of(cls, block: np.dtype, layer: int, index: int, num_experts: int) -> LayerWords:
        """Layer ``layer``'s words in ``block`` (a ``block_dtype``), ``index``: its position."""
        base = _word(block, layer_field(layer))
        region = field_of(block, layer_field(layer))[0]

        def at(name: str) -> int:
            return base + _word(region, name)

        def vector(name: str) -> int:
            return _word(block, name) + index

        return cls(
            req_at=vector("requests"),
            done_at=vector("answers"),
            base=at("header"),
            tab=at("slot_of"),
            last=at("last_used"),
            reqi=at("request"),
            csrc=at("copy_src"),
            cdst=at("copy_dst"),
            n_experts=num_experts,
            fault_at=vector("faults"),
            tick_at=vector("ticks"),
            hseq=vector("hints"),
            hint=at("hint"),
        )

    def meta(self, ctrl: int, staging: int, sources: Sequence[int] = ()) -> np.ndarray:
        """The kernels' ``meta`` words (int32): these offsets, the control block's and the
        staging's device addresses, then each source's (``META_SOURCES``)."""
        head = np.zeros((), META)
        for name in META.names or ():
            if name not in ("ctrl", "staging"):
                head[name] = getattr(self, name)
        head["ctrl"] = ctrl
        head["staging"] = staging
        tail = np.array(list(sources), "<u8")
        return np.concatenate([head.reshape(1).view("<i4"), tail.view("<i4")])


@dataclass
class TableLayer:
    """One layer's part of the control block; the arrays are views into it."""

    index: int  # its word in the per-layer vectors
    words: LayerWords  # where its words are, for the kernels' meta
    num_experts: int
    n_slots: int
    header: np.ndarray  # a 0-d ``HEADER`` record: ``header["ncopy"]``
    slot_of: np.ndarray  # expert -> slot, -1: absent
    last_used: np.ndarray  # slot -> clock value of its last use by the GPU (-1: none)
    request: np.ndarray  # experts of the pending GPU request
    copy_src: np.ndarray  # staging row ...
    copy_dst: np.ndarray  # ... -> slot, for the next fill
    host_request: np.ndarray  # experts of the pending host request
    host_missing: np.ndarray  # its answer: the experts that were not resident ...
    host_victims: np.ndarray  # ... and the slots they were given
    hint: np.ndarray  # experts of the layer's next calls (a speculative pass's later tokens)
    stats: np.ndarray  # int64 S_* counters
    launches: dict = field(default_factory=dict)  # the model process's kernel launches
    # the model process's ``pinned_files.LayerSources`` when its misses are copied out of the
    # page-locked files (set before the layer's first kernel is made, never changed after)
    sources: Optional[LayerSources] = None


class ControlBlock:
    """The shared words of every table layer (see the module docstring)."""

    # the per-layer vectors (``VECTORS``): one int32 per table layer, in layer order
    requests: np.ndarray
    answers: np.ndarray
    faults: np.ndarray
    ticks: np.ndarray
    expected: np.ndarray
    host_requests: np.ndarray
    host_answers: np.ndarray
    hints: np.ndarray

    def __init__(
        self,
        layers: Mapping[int, Sequence[int]],
        fd: Optional[int] = None,
        allocate: Callable[[int], SharedMapping] = SharedMapping,
    ):
        """``layers``: layer -> (num_experts, n_slots). ``fd``: attach to an existing block, else
        a new one from ``allocate(nbytes)`` (a ``SharedMapping``; pinned for CUDA by the model
        process)."""
        self.spec: Dict[int, Tuple[int, int]] = {
            int(k): (int(v[0]), int(v[1])) for k, v in layers.items()
        }
        self.order = sorted(self.spec)
        self.dtype = block_dtype(self.spec)
        nbytes = self.dtype.itemsize
        self.buffer = allocate(nbytes) if fd is None else SharedMapping(nbytes, fd)
        # the whole block, a 0-d record whose fields are views of the shared memory
        self.block = self.buffer.array[:nbytes].view(self.dtype).reshape(())
        # every int32 word (the kernels' offsets count from its start)
        self.words = self.buffer.array[: field_of(self.dtype, "stats")[1]].view(np.int32)
        self.globals = self.block["globals"]  # a 0-d ``GLOBALS`` record: ``globals["ready"]``
        for name in VECTORS:
            setattr(self, name, self.block[name])
        self.message = self.block["message"]
        stats = self.block["stats"]
        self.layers: Dict[int, TableLayer] = {}
        for i, layer in enumerate(self.order):
            e, s = self.spec[layer]
            region = self.block[layer_field(layer)]
            if self.buffer.owner:
                region["slot_of"] = -1
                region["last_used"] = -1
            self.layers[layer] = TableLayer(
                index=i,
                words=LayerWords.of(self.dtype, layer, i, e),
                num_experts=e,
                n_slots=s,
                header=region["header"],
                slot_of=region["slot_of"],
                last_used=region["last_used"],
                request=region["request"],
                copy_src=region["copy_src"],
                copy_dst=region["copy_dst"],
                host_request=region["host_request"],
                host_missing=region["host_missing"],
                host_victims=region["host_victims"],
                hint=region["hint"],
                stats=stats[i],
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
        return int(self.ticks[i]) + int(self.layers[self.order[i]].header["host_ticks"])

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
