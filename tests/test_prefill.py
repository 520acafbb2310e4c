"""Prefill at small budgets: whole-layer reads without a host sync (``WholeLayerPrefill``, from
``Tuning.prefill_whole_layer`` rows per expert) are exact, bounded, read the next layer ahead,
and leave nothing corrupted behind a failed read."""

import contextlib
import errno
import itertools
import os
import threading

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import moeflux_mlx
from moeflux_mlx.cache.whole_layer import OBSERVE_ROWS, WholeLayerPrefill
from moeflux_mlx.errors import ExpertReadError
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.options import DEFAULT_PREFILL_WHOLE_LAYER, LoadOptions
from tests.support.tuning import tuned

ROWS = 2.0  # the tiny models route 4 of 16 experts: a 40-token prompt has 10 rows per expert


# how slots and whole layers are written: from the host, or through device staging (a
# prefill's layers then copied out of it by the copy engine on CUDA, from host rows elsewhere)
WRITES = ["host", "device"]


def _prompt(n=40):
    return mx.array(np.random.default_rng(0).integers(0, 256, n).astype(np.uint32))


def _greedy(model, prompt, n=6):
    return [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))]


def _prefill_logits(model, prompt):
    """Logits of every prompt position, as one forward pass computes them."""
    out = model(prompt[None], cache=make_prompt_cache(model))
    mx.eval(out)
    return out


def _split_logits(model, prompt, last):
    """Logits of the prompt's ``last`` positions, computed as one call after the others."""
    cache = make_prompt_cache(model)
    mx.eval(model(prompt[None, :-last], cache=cache))
    out = model(prompt[None, -last:], cache=cache)
    mx.eval(out)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    src, packed = tiny_checkpoints["qwen3_moe"]
    stock, _ = mlx_lm.load(str(src))
    prompt = _prompt()
    return packed, prompt, _prefill_logits(stock, prompt), _greedy(stock, prompt)


def _budget(packed, fraction=0.25):
    return int(fraction * expert_layout(packed).total_expert_bytes)


def _load(packed, whole, fraction=0.25, writes=None, device_table=None, **kw):
    """The model at ``fraction`` of its experts with ``prefill_whole_layer=whole``, its slots
    written ``writes`` (None: the machine's choice), through the device-side table or not; its
    expert files read, never pinned (these tests are about the reads)."""
    options = tuned(
        prefill_whole_layer=whole,
        slot_writes=writes,
        device_table=device_table,
        pin_experts=False,
    )
    return moeflux_mlx.load(packed, options=options, cache_budget=_budget(packed, fraction), **kw)[
        0
    ]


@pytest.mark.parametrize("writes", WRITES)
@pytest.mark.parametrize("budget", [0.25, 0.0])
def test_whole_layer_prefill_is_bit_identical(tiny, monkeypatch, writes, budget):
    """Logits of a prefill through whole-layer reads equal stock mlx-lm's and the synced
    path's bit for bit; greedy decode after it too; no host sync in the prefill."""
    packed, prompt, want_logits, want_tokens = tiny
    got = {}
    for whole in (ROWS, 0.0):
        model = _load(packed, whole, budget, writes=writes)
        with model.moeflux as rt:
            assert rt.cache.whole.threshold == whole
            got[whole] = _prefill_logits(model, prompt)
            t = rt.stats.total()
            if whole:  # every layer read whole, none synced
                assert t.calls == t.unsynced_calls == len(rt.layout.layers)
                assert t.experts_read == sum(ly.num_experts for ly in rt.layout.layers.values())
            else:
                assert t.unsynced_calls == 0
            assert _greedy(model, prompt) == want_tokens
    assert mx.array_equal(got[ROWS], want_logits).item()
    assert mx.array_equal(got[0.0], want_logits).item()


def test_short_calls_keep_the_synced_path(tiny, monkeypatch):
    """Below the threshold (decode, short prompts) calls sync and read only their experts;
    the threshold is rows per expert of the layer."""
    packed, prompt, _, want_tokens = tiny
    model = _load(packed, 1000, device_table=False)  # decode: not through the table
    with model.moeflux as rt:
        assert _greedy(model, prompt) == want_tokens
        assert rt.stats.total().unsynced_calls == 0
    model = _load(packed, ROWS, device_table=False)
    with model.moeflux as rt:
        assert _greedy(model, prompt) == want_tokens
        per_layer = {s.unsynced_calls for s in rt.stats.layers.values()}
        assert per_layer == {1}  # the prefill only; the decode steps synced


def test_last_layer_output_is_not_forced(tiny, monkeypatch):
    """A prefill chunk's last MoE layer output, which nothing evaluates, stays lazy: the cache
    holds it without computing it, and a new forward pass forgets it."""
    packed, prompt, _, _ = tiny
    model = _load(packed, ROWS)
    with model.moeflux as rt:
        cache = make_prompt_cache(model)
        model(prompt[None], cache=cache)  # logits never evaluated, as a prefill chunk
        mx.eval([c.state for c in cache])
        pending = rt.cache.whole._pending
        assert pending is not None and pending.layer == max(rt.layout.layers)
        model(prompt[None, :1], cache=cache)  # the next pass, first layer: forgotten
        now = rt.cache.whole._pending
        assert now is None or now.layer < pending.layer


def test_the_threshold_is_the_machine_s_not_the_environment_s(monkeypatch):
    """The threshold is ``Tuning``'s: handed in with the options, never read from a variable,
    and no load option takes it."""
    monkeypatch.setenv("MOEFLUX_PREFILL_WHOLE_LAYER", "0")
    assert LoadOptions.resolve().tuning.prefill_whole_layer == DEFAULT_PREFILL_WHOLE_LAYER
    assert tuned(prefill_whole_layer=8).tuning.prefill_whole_layer == 8
    with pytest.raises(TypeError, match="prefill_whole_layer"):
        LoadOptions.resolve(prefill_whole_layer=8)


def _fault_preadv(monkeypatch, after: int):
    real = os.preadv
    calls = itertools.count()

    def fake(fd, buffers, offset, *args):
        if not args and next(calls) >= after:  # reads, not the page-cache probes (flags)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", fake)
    return lambda: monkeypatch.setattr(os, "preadv", real)


@pytest.mark.parametrize("after", [0, 3])
@pytest.mark.parametrize("writes", WRITES)
def test_read_fault_mid_whole_layer(tiny, monkeypatch, after, writes):
    """A disk error while a layer is read whole raises from the prefill; nothing read before it
    is taken for the experts afterwards: the same model then prefills and decodes exactly."""
    packed, prompt, want_logits, want_tokens = tiny
    model = _load(packed, ROWS, writes=writes, expert_io="pread")
    with model.moeflux:
        restore = _fault_preadv(monkeypatch, after)
        with pytest.raises(ExpertReadError, match="Input/output error"):
            _prefill_logits(model, prompt)
        restore()
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        assert _greedy(model, prompt) == want_tokens


@pytest.mark.parametrize("writes", WRITES)
def test_a_call_beyond_the_slots_reads_only_what_they_lack(
    tiny, tiny_checkpoints, monkeypatch, writes
):
    """A short multi-token call (a speculative pass) routing more experts than a layer's slots is
    staged uncached: the experts the slots hold are copied from them, only the others are read,
    and the logits stay stock's (computed in the same calls: on a GPU a 3-token call rounds
    unlike the same rows of a longer one)."""
    packed, prompt, _, want_tokens = tiny
    stock, _ = mlx_lm.load(str(tiny_checkpoints["qwen3_moe"][0]))
    want = _split_logits(stock, prompt, 3)[0]
    # every call synced; ops: on a GPU a 3-token call would run the fused kernels, whose bf16
    # rounding is not stock's
    model = _load(packed, 0, writes=writes, device_table=False, backend="ops")
    with model.moeflux as rt:
        assert _greedy(model, prompt) == want_tokens  # the slots now hold the decode's experts
        cache = make_prompt_cache(model)
        mx.eval(model(prompt[None, :-3], cache=cache))
        rt.reset_stats()
        slots = rt.cache.slots
        held = {i: set(np.flatnonzero(slots.slot_of(i) >= 0).tolist()) for i in slots.pools}
        out = model(prompt[None, -3:], cache=cache)  # 3 tokens: more experts than 4 slots
        mx.eval(out)
        assert mx.array_equal(out[0], want).item()
        stats = rt.stats.layers
        copied = 0
        for i, s in stats.items():
            assert s.experts_routed > slots.n_slots[i]  # staged uncached
            assert s.experts_read == s.experts_missed
            copied += s.experts_routed - s.experts_read
            assert s.experts_routed - s.experts_read <= len(held[i])
        assert copied > 0


def _reads_of(monkeypatch, store):
    """The layers of every whole-layer read of ``store``, in order."""
    seen = []
    real = store.read

    def read(layer, experts, out=None, whole=False):
        if len(experts) == store.layout(layer).num_experts:
            seen.append(layer)
        return real(layer, experts, out, whole)

    monkeypatch.setattr(store, "read", read)
    return seen


def _read_ahead_log(monkeypatch, on_start=None):
    """The layers actually read ahead (``WholeLayerReads.ahead`` started a read), in order;
    ``on_start(layer)`` runs after each."""
    from moeflux_mlx.cache.whole_layer import WholeLayerReads

    started = []
    real = WholeLayerReads.ahead

    def ahead(self, layer):
        real(self, layer)
        if self._ahead is not None and self._ahead.layer == layer:
            started.append(layer)
            if on_start is not None:
                on_start(layer)

    monkeypatch.setattr(WholeLayerReads, "ahead", ahead)
    return started


@pytest.mark.parametrize("writes", WRITES)
def test_next_layer_is_read_ahead(tiny, monkeypatch, writes):
    """Every layer after the first is read while the one before computes and taken from that
    read, each layer read once. Bit-identical."""
    packed, prompt, want_logits, want_tokens = tiny
    started = _read_ahead_log(monkeypatch)
    model = _load(packed, ROWS, writes=writes, expert_io="pread")
    with model.moeflux as rt:
        seen = _reads_of(monkeypatch, rt.store)
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        layers = sorted(rt.layout.layers)
        assert seen == layers  # each layer read once, in order
        assert started == layers[1:]
        assert rt.stats.total().experts_read == sum(
            ly.num_experts for ly in rt.layout.layers.values()
        )
        assert _greedy(model, prompt) == want_tokens


@pytest.mark.parametrize("writes", WRITES)
def test_failed_read_ahead_is_read_again(tiny, monkeypatch, writes):
    """A read ahead that fails once (a passing fault) is read again by the call that needs the
    layer: the prefill is exact and nothing is half-taken."""
    packed, prompt, want_logits, want_tokens = tiny
    armed, failed = [], []
    _read_ahead_log(monkeypatch, on_start=armed.append)
    model = _load(packed, ROWS, writes=writes, expert_io="pread")
    real = os.preadv

    def flaky(fd, buffers, offset, *args):
        # the first piece read after a read ahead started (not a page-cache probe: it has flags)
        if armed and not failed and not args:
            failed.append(offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *args)

    with model.moeflux as rt:
        monkeypatch.setattr(os, "preadv", flaky)
        seen = _reads_of(monkeypatch, rt.store)
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        monkeypatch.setattr(os, "preadv", real)
        assert failed  # the fault was hit, by the read ahead of the second layer
        assert seen == sorted(seen) and len(seen) == len(set(seen)) + 1  # read again, once
        assert seen.count(sorted(rt.layout.layers)[1]) == 2
        assert _greedy(model, prompt) == want_tokens


def test_no_read_ahead_beyond_the_memory_share(tiny, monkeypatch):
    """A layer larger than the share of available memory is not read ahead."""
    from moeflux_mlx.cache import whole_layer

    packed, prompt, want_logits, _ = tiny
    monkeypatch.setattr(whole_layer, "READ_AHEAD_RAM_SHARE", 1e-12)
    started = _read_ahead_log(monkeypatch)
    model = _load(packed, ROWS, expert_io="pread")
    with model.moeflux:
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        assert started == []


@pytest.mark.parametrize("writes", WRITES)
def test_interrupt_while_a_read_ahead_runs(tiny, monkeypatch, writes):
    """An interrupt (Ctrl-C) while the prefill waits for a read ahead that is still running leaves
    that read tracked: the next prefill waits for it before reusing its buffer, and is exact."""
    from moeflux_mlx.cache import whole_layer

    packed, prompt, want_logits, want_tokens = tiny
    model = _load(packed, ROWS, writes=writes, expert_io="pread")
    interrupted = []

    def slow_then_interrupt(layer):
        # the read ahead of this layer is slow, and the wait for it interrupted, once
        reads = model.moeflux.cache.whole.reads
        future = reads._ahead.future
        real_result = future.result

        def result(*args, **kwargs):
            interrupted.append(layer)
            future.result = real_result
            raise KeyboardInterrupt

        future.result = result

    real_fill = whole_layer._fill
    second = sorted(model.moeflux.layout.layers)[1]  # the first layer read ahead
    looked = threading.Event()

    def slow_fill(store, read):
        if read.layer == second and not looked.is_set():
            looked.wait(60)  # still running when the test looks, however slow the machine
        real_fill(store, read)

    monkeypatch.setattr(whole_layer, "_fill", slow_fill)
    armed = []

    def on_start(layer):
        if not armed:
            armed.append(layer)
            slow_then_interrupt(layer)

    _read_ahead_log(monkeypatch, on_start=on_start)
    with model.moeflux as rt:
        with pytest.raises(KeyboardInterrupt):
            _prefill_logits(model, prompt)
        ahead = rt.cache.whole.reads._ahead
        assert interrupted and ahead is not None and not ahead.future.done()  # still tracked
        looked.set()
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        assert _greedy(model, prompt) == want_tokens


@pytest.mark.parametrize("writes", WRITES)
def test_a_read_ahead_that_cannot_be_queued_is_read_by_its_call(tiny, monkeypatch, writes):
    """A read ahead whose queueing fails (here: the thread refuses it) is not tracked; the call
    that needs the layer then reads it itself, exactly, and every layer is read once."""
    from moeflux_mlx.cache import whole_layer

    packed, prompt, want_logits, _ = tiny
    monkeypatch.setattr(whole_layer, "STAGING_KEEP_BYTES", 0)  # every read: a buffer of its own
    real_start = whole_layer.WholeLayerReads._start
    refused = []

    def start(self, read):
        if self._ahead is None and not refused and read.layer > 0:  # the first read ahead
            refused.append(read.layer)
            raise RuntimeError("cannot schedule new futures after shutdown")
        real_start(self, read)

    monkeypatch.setattr(whole_layer.WholeLayerReads, "_start", start)
    model = _load(packed, ROWS, writes=writes, expert_io="pread")
    with model.moeflux as rt:
        seen = _reads_of(monkeypatch, rt.store)
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        assert seen == sorted(rt.layout.layers)
    assert refused


@pytest.mark.parametrize(
    "shape, dtype",
    [((37, 24, 10), "BF16"), ((37, 3, 5), "F16"), ((37, 2, 1), "F32")],  # 16-, 2-, 8-byte rows
)
def test_layer_copy_copies_every_component(shape, dtype):
    """``PinnedStaging`` (CUDA: page-locked, copied by the copy engine, each component a strided
    copy out of the packed rows) gives each component's bytes of every expert, padding left
    out, and reuses its buffers; ``copy_layer`` copies contiguous sources (the pinned files'
    components) the same way; without CUDA, the same through host rows."""
    from moeflux_mlx.cuda import layer_copy
    from moeflux_mlx.cuda.pinned_files import LayerSources
    from moeflux_mlx.format.layout import ExpertLayout

    n = shape[0]
    layout = ExpertLayout.from_tensors(
        {
            "gate_proj.weight": (dtype, shape),
            "up_proj.weight": (dtype, shape),
            "down_proj.weight": ("BF16", (n, 40, 8)),
        },
        None,
    )
    staging = layer_copy.PinnedStaging()
    try:
        for turn in range(3):
            rows = np.random.default_rng(turn).integers(0, 256, (n, layout.blob_size), np.uint8)
            staging.buffer(turn % 2, n, layout.blob_size)[:] = rows
            got = staging.copy(turn % 2, layout, "layer 0")
            for c in layout.components:
                want = rows[:, c.offset : c.offset + c.nbytes]
                assert np.array_equal(np.array(got[c.name]), want), (turn, c.name)
        assert staging.nbytes <= 2 * n * layout.blob_size
        # contiguous components, as the pinned files hold them: one page-locked run each
        buf = staging.buffer(0, n, layout.blob_size).reshape(-1)
        rng = np.random.default_rng(9)
        buf[:] = rng.integers(0, 256, buf.size, np.uint8)
        base = staging._bufs[0].device_ptr
        at, ptrs, parts = 0, [], []
        for c in layout.components:
            ptrs.append(base + at if base else 0)
            parts.append(buf[at : at + n * c.nbytes].reshape(n, c.nbytes))
            at += n * c.nbytes
        sources = LayerSources(ptrs, [c.nbytes for c in layout.components], parts)
        got = layer_copy.copy_layer(sources, layout, "layer 0")
        for c, want in zip(layout.components, parts):
            assert np.array_equal(np.array(got[c.name]), want), c.name
    finally:
        staging.close()
    assert staging.nbytes == 0


def test_a_failed_copy_names_the_layer_and_waits_for_the_rest(monkeypatch):
    """A copy the CUDA runtime refuses raises ``DeviceCopyError`` naming the layer, the call,
    the component and CUDA's words, after waiting for the copies already queued (none left in
    flight). CUDA's runtime and the address kernel are stood in for: this runs on any machine."""
    import types

    from moeflux_mlx.cuda import layer_copy
    from moeflux_mlx.cuda import runtime as cuda_runtime
    from moeflux_mlx.cuda.pinned_files import LayerSources
    from moeflux_mlx.errors import DeviceCopyError
    from moeflux_mlx.format.layout import ExpertLayout

    n = 4
    layout = ExpertLayout.from_tensors(
        {
            "gate_proj.weight": ("BF16", (n, 8, 4)),
            "up_proj.weight": ("BF16", (n, 8, 4)),
            "down_proj.weight": ("BF16", (n, 4, 8)),
        },
        None,
    )
    calls = []

    def call(name, result):
        def f(*args):
            calls.append(name)
            return result

        return f

    lib = types.SimpleNamespace(
        cudaStreamCreateWithFlags=call("create", 0),
        cudaMemcpyAsync=call("copy", 0),
        cudaMemcpy2DAsync=call("copy2d", 700),  # cudaErrorIllegalAddress
        cudaStreamSynchronize=call("sync", 0),
        cudaGetErrorString=lambda err: b"an illegal memory access was encountered",
    )
    monkeypatch.setattr(cuda_runtime, "_cudart", lambda: (lib, "13"))
    monkeypatch.setattr(layer_copy, "_address_stream", lambda: mx.cpu)

    def made(inputs, output_shapes, output_dtypes, **launch):
        return [mx.zeros(output_shapes[0], mx.uint8), mx.array([4096], mx.uint64)]

    monkeypatch.setattr(layer_copy, "_address_kernel", lambda: made)
    layer_copy._copy_stream.cache_clear()
    try:
        rows = np.zeros((n, layout.blob_size), np.uint8)
        sources = LayerSources(
            [1 << 20] * 3,
            [layout.blob_size] * 3,  # strided: every component is a 2-D copy
            [rows[:, c.offset : c.offset + c.nbytes] for c in layout.components],
        )
        with pytest.raises(DeviceCopyError) as err:
            layer_copy.copy_layer(sources, layout, "layer 3")
    finally:
        layer_copy._copy_stream.cache_clear()
    assert str(err.value) == (
        "layer 3: copying the experts to the device failed (cudaMemcpy2DAsync of "
        "gate_proj.weight: an illegal memory access was encountered); load the model again"
    )
    assert calls == ["create", "copy2d", "sync"]


@contextlib.contextmanager
def _after_a_prefill(monkeypatch, packed, prompt, **kw):
    """The model (pread, whole-layer reads) once a prefill chunk of ``prompt`` has computed
    (its logits never evaluated) and the next pass has started, so that every layer but the
    last is done with; yields ``(model, runtime, each layer's router indices)``."""
    routed = {}
    real = WholeLayerPrefill.lookup

    def spy(self, layer, indices, stats):
        routed[layer] = indices
        return real(self, layer, indices, stats)

    monkeypatch.setattr(WholeLayerPrefill, "lookup", spy)
    model = _load(packed, ROWS, expert_io="pread", **kw)
    with model.moeflux as rt:
        cache = make_prompt_cache(model)
        model(prompt[None], cache=cache)
        mx.eval([c.state for c in cache])
        rt.cache.whole.begin(0)
        assert sorted(routed) == sorted(rt.layout.layers)
        yield model, rt, routed


def test_a_prefill_teaches_the_eviction_policy_its_routing(tiny, monkeypatch):
    """Once each whole-layer call has computed, its layer's policy learns the routing of its
    latest rows (as many calls on its clock, the last of them as the call before the next),
    and the slots stay empty (a prefill fills no slot); not the last layer, whose output a
    prefill never computes. Greedy decode stays exact. The host-synced lookup's policies
    (``PolicyBook``): on CUDA the device-side table's miss server keeps them, and
    test_device_table.py's teaching test looks there."""
    packed, prompt, _, want_tokens = tiny
    with _after_a_prefill(
        monkeypatch, packed, prompt, device_table=False, eviction="transition"
    ) as (model, rt, routed):
        layers = sorted(routed)
        assert not rt.cache.slots.pools  # learning allocates no slot
        for layer in layers:
            book = rt.cache.slots.books.get(layer)
            policy = None if book is None else book.policy
            if layer == layers[-1]:
                assert policy is None or int(policy.clock[0]) == 0
                continue
            assert policy is not None
            rows = np.array(routed[layer]).reshape(-1, routed[layer].shape[-1])[-OBSERVE_ROWS:]
            assert int(policy.clock[0]) == len(rows)
            assert policy.previous.tolist() == sorted(set(rows[-1].tolist()))
            assert (policy.slot_of < 0).all()  # learnt, nothing admitted
            assert policy.calls[np.unique(rows[:-1])].min() > 0  # each led a call it saw
        assert _greedy(model, prompt) == want_tokens
