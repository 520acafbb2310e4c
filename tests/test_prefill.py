"""Prefill at small budgets: whole-layer reads without a host sync (``prefill_whole_layer``) are
exact, bounded, and leave nothing corrupted behind a failed read."""

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
from moeflux_mlx.errors import ExpertReadError
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.options import LoadOptions

ROWS = 2.0  # the tiny models route 4 of 16 experts: a 40-token prompt has 10 rows per expert


# how slots and whole layers are written: from the host; through device staging, a prefill's
# layers by copies beside MLX (the GPU's copy engines; host copies on the CPU: prefill_dma); or
# through device staging and a copy kernel (the default)
WRITES = ["host", "device", "device-kernel"]


def _set_writes(monkeypatch, writes):
    monkeypatch.setenv("MOEFLUX_SLOT_WRITES", writes.split("-")[0])
    monkeypatch.setenv("MOEFLUX_PREFILL_DMA", "off" if writes == "device-kernel" else "on")


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


def _load(monkeypatch, packed, whole, fraction=0.25, **kw):
    """The model at ``fraction`` of its experts with ``prefill_whole_layer=whole`` (set through
    its variable: the caches read it when they are made)."""
    monkeypatch.setenv("MOEFLUX_PREFILL_WHOLE_LAYER", str(whole))
    return moeflux_mlx.load(packed, cache_budget=_budget(packed, fraction), **kw)[0]


@pytest.mark.parametrize("writes", WRITES)
@pytest.mark.parametrize("budget", [0.25, 0.0])
def test_whole_layer_prefill_is_bit_identical(tiny, monkeypatch, writes, budget):
    """Logits of a prefill through whole-layer reads equal stock mlx-lm's and the synced
    path's bit for bit; greedy decode after it too; no host sync in the prefill."""
    packed, prompt, want_logits, want_tokens = tiny
    _set_writes(monkeypatch, writes)
    got = {}
    for whole in (ROWS, 0.0):
        model = _load(monkeypatch, packed, whole, budget)
        with model.moeflux as rt:
            assert rt.cache.prefill_whole_layer == whole
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
    model = _load(monkeypatch, packed, 1000, device_table=False)  # decode: not through the table
    with model.moeflux as rt:
        assert _greedy(model, prompt) == want_tokens
        assert rt.stats.total().unsynced_calls == 0
    model = _load(monkeypatch, packed, ROWS, device_table=False)
    with model.moeflux as rt:
        assert _greedy(model, prompt) == want_tokens
        per_layer = {s.unsynced_calls for s in rt.stats.layers.values()}
        assert per_layer == {1}  # the prefill only; the decode steps synced


def test_last_layer_output_is_not_forced(tiny, monkeypatch):
    """A prefill chunk's last MoE layer output, which nothing evaluates, stays lazy: the cache
    holds it without computing it, and a new forward pass forgets it."""
    packed, prompt, _, _ = tiny
    model = _load(monkeypatch, packed, ROWS)
    with model.moeflux as rt:
        cache = make_prompt_cache(model)
        model(prompt[None], cache=cache)  # logits never evaluated, as a prefill chunk
        mx.eval([c.state for c in cache])
        pending = rt.cache._pending
        assert pending is not None and pending[0] == max(rt.layout.layers)
        model(prompt[None, :1], cache=cache)  # the next pass, first layer: forgotten
        assert rt.cache._pending is None or rt.cache._pending[0] < pending[0]


def test_option_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOEFLUX_PREFILL_WHOLE_LAYER", "0")
    assert LoadOptions.resolve().prefill_whole_layer == 0
    assert LoadOptions.resolve(prefill_whole_layer=8).prefill_whole_layer == 8
    monkeypatch.setenv("MOEFLUX_PREFILL_WHOLE_LAYER", "-1")
    with pytest.raises(ValueError, match="MOEFLUX_PREFILL_WHOLE_LAYER"):
        LoadOptions.resolve()


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
    _set_writes(monkeypatch, writes)
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
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
    _set_writes(monkeypatch, writes)
    # every call synced; ops: on a GPU a 3-token call would run the fused kernels, whose bf16
    # rounding is not stock's
    model = _load(monkeypatch, packed, 0, device_table=False, backend="ops")
    with model.moeflux as rt:
        assert _greedy(model, prompt) == want_tokens  # the slots now hold the decode's experts
        cache = make_prompt_cache(model)
        mx.eval(model(prompt[None, :-3], cache=cache))
        rt.reset_stats()
        held = {i: set(np.flatnonzero(rt.cache.slot_of(i) >= 0).tolist()) for i in rt.cache.pools}
        out = model(prompt[None, -3:], cache=cache)  # 3 tokens: more experts than 4 slots
        mx.eval(out)
        assert mx.array_equal(out[0], want).item()
        stats = rt.stats.layers
        copied = 0
        for i, s in stats.items():
            assert s.experts_routed > rt.cache.n_slots[i]  # staged uncached
            assert s.experts_read == s.experts_missed
            copied += s.experts_routed - s.experts_read
            assert s.experts_routed - s.experts_read <= len(held[i])
        assert copied > 0


def _reads_of(monkeypatch, store):
    """The layers of every whole-layer read of ``store``, in order."""
    seen = []
    real = store.read

    def read(layer, experts, out=None):
        if len(experts) == store.layout(layer).num_experts:
            seen.append(layer)
        return real(layer, experts, out)

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
@pytest.mark.parametrize("ahead", [True, False])
def test_next_layer_is_read_ahead(tiny, monkeypatch, writes, ahead):
    """With read-ahead on, every layer after the first is read while the one before computes
    and taken from that read; off, none. Bit-identical either way."""
    packed, prompt, want_logits, want_tokens = tiny
    _set_writes(monkeypatch, writes)
    monkeypatch.setenv("MOEFLUX_PREFILL_READ_AHEAD", "on" if ahead else "off")
    started = _read_ahead_log(monkeypatch)
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    with model.moeflux as rt:
        seen = _reads_of(monkeypatch, rt.store)
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        layers = sorted(rt.layout.layers)
        assert seen == layers  # each layer read once, in order
        assert started == (layers[1:] if ahead else [])
        assert rt.stats.total().experts_read == sum(
            ly.num_experts for ly in rt.layout.layers.values()
        )
        assert _greedy(model, prompt) == want_tokens


@pytest.mark.parametrize(
    "field,var,default",
    [
        ("prefill_read_ahead", "READ_AHEAD", True),
        ("prefill_dma", "DMA", False),
        ("prefill_warm_slots", "WARM_SLOTS", False),
        ("prefill_learns", "LEARNS", True),
    ],
)
def test_prefill_switches(monkeypatch, field, var, default):
    assert getattr(LoadOptions.resolve(), field) is default
    monkeypatch.setenv(f"MOEFLUX_PREFILL_{var}", "off")
    assert getattr(LoadOptions.resolve(), field) is False
    monkeypatch.setenv(f"MOEFLUX_PREFILL_{var}", "on")
    assert getattr(LoadOptions.resolve(), field) is True
    monkeypatch.setenv(f"MOEFLUX_PREFILL_{var}", "sometimes")
    with pytest.raises(ValueError, match=f"MOEFLUX_PREFILL_{var}"):
        LoadOptions.resolve()


@pytest.mark.parametrize("writes", WRITES)
def test_failed_read_ahead_is_read_again(tiny, monkeypatch, writes):
    """A read ahead that fails once (a passing fault) is read again by the call that needs the
    layer: the prefill is exact and nothing is half-taken."""
    packed, prompt, want_logits, want_tokens = tiny
    _set_writes(monkeypatch, writes)
    armed, failed = [], []
    _read_ahead_log(monkeypatch, on_start=armed.append)
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
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
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    with model.moeflux:
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        assert started == []


@pytest.mark.parametrize("writes", WRITES)
def test_interrupt_while_a_read_ahead_runs(tiny, monkeypatch, writes):
    """An interrupt (Ctrl-C) while the prefill waits for a read ahead that is still running leaves
    that read tracked: the next prefill waits for it before reusing its buffer, and is exact."""
    from moeflux_mlx.cache import whole_layer

    packed, prompt, want_logits, want_tokens = tiny
    _set_writes(monkeypatch, writes)
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    interrupted = []

    def slow_then_interrupt(layer):
        # the read ahead of this layer is slow, and the wait for it interrupted, once
        reads = model.moeflux.cache.whole_reads
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

    def slow_fill(store, read, copies):
        if read.layer == second and not looked.is_set():
            looked.wait(60)  # still running when the test looks, however slow the machine
        real_fill(store, read, copies)

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
        ahead = rt.cache.whole_reads._ahead
        assert interrupted and ahead is not None and not ahead.future.done()  # still tracked
        looked.set()
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        assert _greedy(model, prompt) == want_tokens


def test_host_row_copies_copy_strided_rows():
    """``HostRowCopies`` copies ``rows`` rows of ``width`` bytes between pitches, as
    ``cudaMemcpy2DAsync`` does, and nothing outside them."""
    from moeflux_mlx.cache.row_copies import HostRowCopies

    copies = HostRowCopies()
    src = copies.buffer(5 * 24)
    src.array[:] = np.arange(5 * 24) % 251
    both = np.full(5 * 11 + 8, 77, np.uint8)  # 5 rows 11 bytes apart, then 8 more
    copies.copy_rows(both.ctypes.data, 11, src.array.ctypes.data + 3, 24, 7, 5)
    copies.wait()
    rows = both[:55].reshape(5, 11)
    assert np.array_equal(rows[:, :7], src.array.reshape(5, 24)[:, 3:10])
    assert (rows[:, 7:] == 77).all() and (both[55:] == 77).all()  # between rows, after: untouched
    copies.copy_rows(both.ctypes.data, 11, src.array.ctypes.data, 24, 7, 0)  # no rows: nothing


def _log_copies(monkeypatch, copies, events):
    """Each copy queued by ``copies`` (the cache's: host copies on the CPU, the copy engines on a
    GPU), and the buffers it hands out and gets back."""
    real_copy, real_buffer = copies.copy_rows, copies.buffer

    def copy_rows(dst, dst_pitch, src, src_pitch, width, rows):
        events.append(("copy", rows))
        real_copy(dst, dst_pitch, src, src_pitch, width, rows)

    def buffer(nbytes):
        buf = real_buffer(nbytes)
        real_close = buf.close

        def close():
            events.append(("close", nbytes))
            real_close()

        buf.close = close
        events.append(("buffer", nbytes))
        return buf

    monkeypatch.setattr(copies, "copy_rows", copy_rows)
    monkeypatch.setattr(copies, "buffer", buffer)


def test_copies_follow_each_piece_read(tiny, monkeypatch):
    """With copies beside MLX each piece of a layer is copied as soon as it is read, every
    component of every expert once; a layer too large to keep a buffer for gets one of its own,
    let go after its read. The prefill is exact."""
    from moeflux_mlx.cache import whole_layer

    packed, prompt, want_logits, want_tokens = tiny
    _set_writes(monkeypatch, "device")
    layout = expert_layout(packed)
    first = layout.layers[min(layout.layers)]
    monkeypatch.setattr(whole_layer, "COPY_PIECE_BYTES", 3 * first.blob_size)
    monkeypatch.setattr(whole_layer, "STAGING_KEEP_BYTES", 0)  # every layer: a buffer of its own
    events = []
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    with model.moeflux as rt:
        _log_copies(monkeypatch, rt.cache.whole_reads.copies, events)
        real_read = rt.store.read

        def read(layer, experts, out=None):
            events.append(("read", len(experts)))
            return real_read(layer, experts, out)

        monkeypatch.setattr(rt.store, "read", read)
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
        n_comp = len(first.components)
        n = first.num_experts
        pieces = [min(3, n - lo) for lo in range(0, n, 3)]
        per_layer = []
        for p in pieces:
            per_layer += [("read", p)] + [("copy", p)] * n_comp
        nbytes = n * first.blob_size
        layer_events = [e for e in events if e[0] in ("read", "copy")]
        assert layer_events == per_layer * len(layout.layers)
        assert events.count(("buffer", nbytes)) == events.count(("close", nbytes))
        assert events.count(("buffer", nbytes)) == len(layout.layers)
        assert _greedy(model, prompt) == want_tokens


def test_a_failed_piece_waits_for_the_copies_queued(tiny, monkeypatch):
    """A read failing after some pieces were copied waits for those copies and lets its own
    buffer go before the error is raised."""
    from moeflux_mlx.cache import whole_layer

    packed, prompt, want_logits, _ = tiny
    _set_writes(monkeypatch, "device")
    first = expert_layout(packed).layers[0]
    monkeypatch.setattr(whole_layer, "COPY_PIECE_BYTES", 3 * first.blob_size)
    monkeypatch.setattr(whole_layer, "STAGING_KEEP_BYTES", 0)
    monkeypatch.setenv("MOEFLUX_PREFILL_READ_AHEAD", "off")  # the first failure raises
    events = []
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    with model.moeflux as rt:
        copies = rt.cache.whole_reads.copies
        _log_copies(monkeypatch, copies, events)
        real_wait = copies.wait

        def wait():
            events.append(("wait",))
            real_wait()

        monkeypatch.setattr(copies, "wait", wait)
        real_read = rt.store.read

        def read(layer, experts, out=None):
            if experts[0] == 3:  # the second piece of the first layer
                raise ExpertReadError("expert file: Input/output error")
            return real_read(layer, experts, out)

        monkeypatch.setattr(rt.store, "read", read)
        with pytest.raises(ExpertReadError):
            _prefill_logits(model, prompt)
        nbytes = first.num_experts * first.blob_size
        # the read ahead is off: the call reads, fails, reads again on its thread and fails
        tail = [e for e in events if e[0] in ("copy", "wait", "close")]
        once = [("copy", 3)] * len(first.components) + [("wait",), ("close", nbytes)]
        assert tail == once * 2


def test_copy_engine_names_a_failed_copy_and_syncs_on_wait():
    """``CopyEngine`` (against a stand-in for libcudart): each copy is queued on the engine's
    stream on the device it was made on, from whatever thread; a failed one raises naming it;
    ``wait`` synchronizes the stream; ``close`` destroys it."""
    import threading
    import types

    from moeflux_mlx.cuda.copy_engine import CopyEngine
    from moeflux_mlx.errors import DeviceSetupError

    calls = []

    def fn(name):
        def call(*args):
            calls.append((name, [getattr(a, "value", a) for a in args]))
            return 0

        return call

    def memcpy(dst, dpitch, src, spitch, width, rows, kind, stream):
        args = [dst, dpitch, src, spitch, width, rows, kind, stream]
        calls.append(("copy", [getattr(a, "value", a) for a in args]))
        return 700 if dst.value == 2 else 0

    def get_device(ref):
        ref._obj.value = 3
        return 0

    lib = types.SimpleNamespace(
        cudaMemcpy2DAsync=memcpy,
        cudaStreamSynchronize=fn("sync"),
        cudaStreamCreateWithFlags=lambda ref, flags: setattr(ref._obj, "value", 99) or 0,
        cudaStreamDestroy=fn("destroy"),
        cudaSetDevice=fn("set device"),
        cudaGetDevice=get_device,
    )
    engine = CopyEngine(lib)
    worker = threading.Thread(target=engine.copy_rows, args=(1, 12, 100, 16, 8, 5))
    worker.start()
    worker.join()
    # cudaMemcpyDefault (4): the direction from the addresses
    assert calls == [("set device", [3]), ("copy", [1, 12, 100, 16, 8, 5, 4, 99])]
    with pytest.raises(DeviceSetupError, match="cudaMemcpy2DAsync of 2 x 8 bytes"):
        engine.copy_rows(2, 8, 100, 16, 8, 2)
    engine.wait()
    assert calls[-1] == ("sync", [99])
    engine.close()
    assert [c[0] for c in calls[-2:]] == ["sync", "destroy"]


def test_a_read_that_cannot_be_queued_lets_its_buffer_go(tiny, monkeypatch):
    """A read ahead whose queueing fails (here: the thread refuses it) lets its own host buffer
    go; the call then reads the layer itself, exactly."""
    from moeflux_mlx.cache import whole_layer

    packed, prompt, want_logits, _ = tiny
    _set_writes(monkeypatch, "device")
    monkeypatch.setattr(whole_layer, "STAGING_KEEP_BYTES", 0)  # every read: a buffer of its own
    real_start = whole_layer.WholeLayerReads._start
    refused = []

    def start(self, read):
        if self._ahead is None and not refused and read.layer > 0:  # the first read ahead
            refused.append(read.layer)
            raise RuntimeError("cannot schedule new futures after shutdown")
        real_start(self, read)

    monkeypatch.setattr(whole_layer.WholeLayerReads, "_start", start)
    events = []
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    with model.moeflux as rt:
        _log_copies(monkeypatch, rt.cache.whole_reads.copies, events)
        assert mx.array_equal(_prefill_logits(model, prompt), want_logits).item()
    assert refused
    assert events.count(("buffer", events[0][1])) == events.count(("close", events[0][1]))


def test_a_failed_wait_after_a_failed_read_keeps_the_read_error(tiny, monkeypatch):
    """If waiting for the copies fails while a read's error is on its way up, the read's error
    is the one raised."""
    packed, prompt, _, _ = tiny
    _set_writes(monkeypatch, "device")
    monkeypatch.setenv("MOEFLUX_PREFILL_READ_AHEAD", "off")
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    with model.moeflux as rt:
        copies = rt.cache.whole_reads.copies

        def wait():
            raise RuntimeError("the stream is broken too")

        monkeypatch.setattr(copies, "wait", wait)

        def read(layer, experts, out=None):
            raise ExpertReadError("expert file: Input/output error")

        monkeypatch.setattr(rt.store, "read", read)
        with pytest.raises(ExpertReadError, match="Input/output error"):
            _prefill_logits(model, prompt)
    # and a wait that fails alone is raised
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    with model.moeflux as rt:
        monkeypatch.setattr(rt.cache.whole_reads.copies, "wait", wait)
        with pytest.raises(RuntimeError, match="stream is broken"):
            _prefill_logits(model, prompt)


def test_layer_copy_kernel_copies_every_component():
    """``cuda.layer_copy`` (CUDA: on a few blocks, out of mapped staging) gives each component's
    bytes of every expert, padding left out, for any block count; where a component is not
    16-byte sized it declines, and MLX's copies are used (everywhere)."""
    from moeflux_mlx.cuda import layer_copy
    from moeflux_mlx.cuda import runtime as cuda_runtime
    from moeflux_mlx.format.layout import ExpertLayout

    layout = ExpertLayout.from_tensors(
        {
            "gate_proj.weight": ("BF16", (37, 24, 10)),  # 480 bytes, padded to 512
            "up_proj.weight": ("BF16", (37, 24, 8)),  # 384
            "down_proj.weight": ("BF16", (37, 40, 8)),  # 640
        },
        None,
    )
    odd = ExpertLayout.from_tensors(
        {"fc1.weight": ("F16", (3, 5, 3)), "fc2.weight": ("F16", (3, 3, 5))}, None
    )  # 30 bytes each
    staged = mx.array(
        np.random.default_rng(1).integers(0, 256, (37, layout.blob_size), dtype=np.uint8)
    )
    assert layer_copy.copy_layer(staged[:, : odd.blob_size], odd) is None
    if not cuda_runtime.table_available():
        pytest.skip("the copy kernel needs MLX's CUDA backend")
    staged = cuda_runtime.host_array((37, layout.blob_size))
    rows = np.random.default_rng(2).integers(0, 256, (37, layout.blob_size), dtype=np.uint8)
    np.frombuffer(memoryview(staged), np.uint8).reshape(37, -1)[:] = rows
    for blocks in (1, 3, 16):
        layer_copy.LAYER_COPY_BLOCKS, was = blocks, layer_copy.LAYER_COPY_BLOCKS
        try:
            got = layer_copy.copy_layer(staged, layout)
        finally:
            layer_copy.LAYER_COPY_BLOCKS = was
        for c in layout.components:
            want = rows[:, c.offset : c.offset + c.nbytes]
            assert np.array_equal(np.array(got[c.name]), want), (blocks, c.name)


@contextlib.contextmanager
def _after_a_prefill(monkeypatch, packed, prompt):
    """The model (pread, whole-layer reads) once a prefill chunk of ``prompt`` has computed
    (its logits never evaluated) and the next pass has started, so that every layer but the
    last is done with; yields ``(model, runtime, each layer's router indices)``."""
    from moeflux_mlx.cache.synced import HostSyncCache

    routed = {}
    real = HostSyncCache.whole_lookup

    def spy(self, layer, indices, stats):
        routed[layer] = indices
        return real(self, layer, indices, stats)

    monkeypatch.setattr(HostSyncCache, "whole_lookup", spy)
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    with model.moeflux as rt:
        cache = make_prompt_cache(model)
        model(prompt[None], cache=cache)
        mx.eval([c.state for c in cache])
        rt.cache.begin_call(0)
        assert sorted(routed) == sorted(rt.layout.layers)
        yield model, rt, routed


@pytest.mark.parametrize("writes", WRITES)
@pytest.mark.parametrize("warm", [True, False])
def test_a_prefill_leaves_its_most_routed_experts_in_the_slots(tiny, monkeypatch, writes, warm):
    """Once each whole-layer call has computed, its layer's slots hold the experts its rows
    routed most (of equals, the latest), with their bytes; not the last layer, whose output a
    prefill never computes. Off, the slots stay empty. Greedy decode stays exact either way."""
    packed, prompt, _, want_tokens = tiny
    _set_writes(monkeypatch, writes)
    monkeypatch.setenv("MOEFLUX_PREFILL_WARM_SLOTS", "on" if warm else "off")
    with _after_a_prefill(monkeypatch, packed, prompt) as (model, rt, routed):
        layers = sorted(routed)
        for layer in layers:
            slot_of = rt.cache.slot_of(layer)
            held = [] if slot_of is None else np.flatnonzero(slot_of >= 0).tolist()
            if not warm or layer == layers[-1]:
                assert held == []
                continue
            idx = np.array(routed[layer]).reshape(-1)
            n = rt.cache.slot_count(layer)
            rank = sorted(
                set(idx.tolist()), key=lambda e: (-np.sum(idx == e), -np.flatnonzero(idx == e)[-1])
            )
            assert held == sorted(rank[:n])
            pool = rt.cache.pools[layer]
            blobs = rt.store.read(layer, np.array(held))
            for c in pool.layout.components:
                got = np.array(pool.raw[c.name])[slot_of[held]]
                assert np.array_equal(got, blobs[:, c.offset : c.offset + c.nbytes]), (
                    layer,
                    c.name,
                )
        assert _greedy(model, prompt) == want_tokens


def test_whole_blobs_gathers_experts_as_stored(tiny, monkeypatch):
    """``whole_blobs`` (what the device-side table writes into slots from a whole-layer pool)
    puts each component at its offset and zeroes the padding: the blobs as the store reads them
    (a converted file pads with zeros), in the order asked for."""
    from moeflux_mlx.cache.pool import whole_blobs

    packed, _, _, _ = tiny
    model = _load(monkeypatch, packed, ROWS, expert_io="pread")
    with model.moeflux as rt:
        layer = min(rt.layout.layers)
        layout = rt.store.layout(layer)
        pool = rt.cache.whole_reads.take(layer, rt.stats.layer(layer))
        experts = np.array([layout.num_experts - 1, 0, 3])
        want = np.stack([rt.store.read(layer, np.array([e]))[0].copy() for e in experts])
        assert np.array_equal(np.array(whole_blobs(pool, layout, experts)), want)


@pytest.mark.parametrize("learns", [True, False])
def test_a_prefill_teaches_the_eviction_policy_its_routing(tiny, monkeypatch, learns):
    """Once each whole-layer call has computed, its layer's policy learns the routing of its
    latest rows (as many calls on its clock, the last of them as the call before the next),
    and the slots stay empty; not the last layer, whose output a prefill never computes. Off,
    the policies learn nothing. Greedy decode stays exact either way. The host-synced lookup's
    policies: on CUDA the device-side table's miss server keeps them, and
    test_device_table.py's teaching test looks there."""
    from moeflux_mlx.cache.synced import OBSERVE_ROWS

    packed, prompt, _, want_tokens = tiny
    monkeypatch.setenv("MOEFLUX_DEVICE_TABLE", "off")
    monkeypatch.setenv("MOEFLUX_PREFILL_LEARNS", "on" if learns else "off")
    monkeypatch.setenv("MOEFLUX_EVICTION", "transition")
    with _after_a_prefill(monkeypatch, packed, prompt) as (model, rt, routed):
        layers = sorted(routed)
        for layer in layers:
            policy = rt.cache.policies.get(layer)
            if not learns or layer == layers[-1]:
                assert policy is None or int(policy.clock[0]) == 0
                continue
            rows = np.array(routed[layer]).reshape(-1, routed[layer].shape[-1])[-OBSERVE_ROWS:]
            assert int(policy.clock[0]) == len(rows)
            assert policy.previous.tolist() == sorted(set(rows[-1].tolist()))
            assert (policy.slot_of < 0).all()  # learnt, nothing admitted
            assert policy.calls[np.unique(rows[:-1])].min() > 0  # each led a call it saw
        assert _greedy(model, prompt) == want_tokens
