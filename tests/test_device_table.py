"""The device-side slot table's host protocol, run on the CPU.

The resolve and fill kernels are CUDA (test_kernels runs them on a GPU). Here a Python reference
of what they do stands in for them, operating on the same control block, while everything else
runs as shipped: the cache's table bookkeeping, the miss service thread, errors, and the
synced path sharing the table during prefill."""

import threading
import time

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import moeflux_mlx
from moeflux_mlx import device_table as dt
from moeflux_mlx.checkpoint import expert_layout
from moeflux_mlx.errors import DeviceWaitError, ExpertReadError
from moeflux_mlx.upload import host_view


def reference_resolve(control, layer, indices, raw, layout):
    """What resolve_cuda.cuh + fill_cuda.cuh do, eagerly, from the main thread."""
    t = control.layers[layer]
    inds = np.array(indices).reshape(-1).astype(np.int64)
    tick = int(control.ticks[t.index]) + 1
    t.header[dt.H_NCOPY] = 0
    if (t.slot_of[inds] < 0).any():
        t.request[:inds.size] = inds
        t.header[dt.H_NREQ] = inds.size
        seq = int(control.answers[t.index]) + 1
        control.requests[t.index] = seq
        deadline = time.monotonic() + 10
        while control.answers[t.index] != seq:  # the service thread answers
            assert time.monotonic() < deadline, "the miss service never answered"
            time.sleep(1e-4)
    slots = t.slot_of[inds].copy()
    assert (slots >= 0).all()
    t.last_used[slots] = tick
    n, poison = int(t.header[dt.H_NCOPY]), bool(t.header[dt.H_ERR])
    rows = control.staging[layout.blob_size].array.reshape(-1, layout.blob_size)
    for k in range(n):
        for c in layout.components:
            dst = host_view(raw[c.name])[t.copy_dst[k]]
            dst[:] = 0xFF if poison else rows[t.copy_src[k], c.offset:c.offset + c.nbytes]
    control.ticks[t.index] = tick
    return mx.array(slots.astype(np.uint32)).reshape(indices.shape)


@pytest.fixture(params=["reference", "cuda"])
def table_on_cpu(request, monkeypatch):
    """The Python reference of the kernels (anywhere), or the CUDA kernels themselves."""
    if request.param == "cuda":
        if not dt.available():
            pytest.skip("the device-side table needs MLX's CUDA backend and libcudart")
        monkeypatch.setenv("MOEFLUX_DEVICE_TABLE", "1")
        return
    monkeypatch.setattr(dt, "enabled", lambda requested=None: requested is not False)
    monkeypatch.setattr(dt, "resolve", reference_resolve)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    src, packed = tiny_checkpoints["qwen3_moe"]
    model, tokenizer = mlx_lm.load(str(src))
    prompt = mx.array(tokenizer.encode("one two three four five six seven"))
    return packed, prompt, _greedy(model, prompt), expert_layout(packed).total_expert_bytes


def _greedy(model, prompt, n=24):
    return [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))]


def _pool_holds_the_right_experts(rt):
    """Every slot the table names holds exactly that expert's bytes from disk."""
    mx.synchronize()  # fills run on the GPU after the host's answer; a step may still be in flight
    for layer, lru in rt.cache.lru.items():
        pool = rt.cache.pools[layer]
        mx.eval(list(pool.raw.values()))
        experts = np.flatnonzero(lru.slot_of >= 0)
        if not experts.size:
            continue
        blobs = rt.store.read(layer, experts)
        for c in pool.layout.components:
            got = np.array(pool.raw[c.name])[lru.slot_of[experts]]
            assert (got == blobs[:, c.offset:c.offset + c.nbytes]).all(), (layer, c.name)
        assert (lru.expert_in[lru.slot_of[experts]] == experts).all()


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_decode_through_the_table_is_exact(table_on_cpu, reference, fraction):
    packed, prompt, want, total = reference
    model, _ = moeflux_mlx.load(packed, cache_budget=int(fraction * total), expert_io="pread",
                                backend="ops")  # the ops path is bit-exact with stock
    with model.moeflux as rt:
        assert rt.cache.control is not None and rt.stats_dict()["device_table"]
        assert _greedy(model, prompt) == want
        t = rt.stats.total()
        assert t.unsynced_calls > 0 and t.calls > t.unsynced_calls  # decode via the table, prefill synced
        assert 0 < t.experts_missed < t.experts_routed
        _pool_holds_the_right_experts(rt)
        assert not rt.cache.service.errors and rt.cache.control.fault() is None


def test_same_misses_as_the_synced_cache(table_on_cpu, reference):
    """The table path and the host-synced path make the same LRU decisions."""
    packed, prompt, _, total = reference
    missed = []
    tokens = []
    for table in (True, False):
        model, _ = moeflux_mlx.load(packed, cache_budget=int(0.3 * total), device_table=table)
        with model.moeflux as rt:
            assert (rt.cache.control is not None) == table
            tokens.append(_greedy(model, prompt))  # default backend: the kernels on a GPU
            rt.stats_dict()
            missed.append({i: s.experts_missed for i, s in rt.stats.layers.items()})
    assert missed[0] == missed[1]
    assert tokens[0] == tokens[1]


def test_failed_read_raises_at_the_next_call_then_recovers(table_on_cpu, reference, monkeypatch):
    packed, prompt, want, total = reference
    model, _ = moeflux_mlx.load(packed, cache_budget=int(0.3 * total), expert_io="pread",
                                backend="ops")
    with model.moeflux as rt:
        store_read = rt.store.read
        failed = []

        def flaky(layer, experts, out=None):
            if threading.current_thread().name == "moeflux-miss-service" and not failed:
                failed.append((layer, experts.copy()))
                raise ExpertReadError(f"layer {layer}: injected read failure")
            return store_read(layer, experts, out)

        monkeypatch.setattr(rt.store, "read", flaky)
        with pytest.raises(ExpertReadError, match="injected"):
            _greedy(model, prompt)
        assert failed
        layer, experts = failed[0]
        assert not rt.cache._poisoned
        # the poisoned slots were released: nothing claims bytes that never arrived
        assert (rt.cache.lru[layer].slot_of[experts] < 0).all()
        _pool_holds_the_right_experts(rt)
        assert _greedy(model, prompt) == want


def test_gpu_fault_raises(table_on_cpu, reference):
    packed, _, _, total = reference
    model, _ = moeflux_mlx.load(packed, cache_budget=int(0.3 * total))
    with model.moeflux as rt:
        control = rt.cache.control
        control.faults[0] = dt.FAULT_TIMEOUT
        with pytest.raises(DeviceWaitError, match=f"layer {control.order[0]}.*waited"):
            rt.cache.check()
        control.faults[0] = dt.FAULT_INDEX
        with pytest.raises(DeviceWaitError, match="out of range"):
            rt.cache.check()
        control.faults[0] = 0


def test_control_block_regions_do_not_overlap():
    layers = {1: (128, 40), 3: (64, 64 - 1), 4: (256, 8)}
    c = dt.ControlBlock(layers)
    owner = np.zeros(c.words.size, np.int64)
    base = c.words.ctypes.data
    views = [c.requests, c.answers, c.faults, c.ticks]
    for t in c.layers.values():
        views += [t.header, t.slot_of, t.last_used, t.request, t.copy_src, t.copy_dst]
        assert t.slot_of.size == t.num_experts and t.last_used.size == t.n_slots
        assert (t.slot_of == -1).all() and (t.last_used == -1).all()
    for v in views:
        start = (v.ctypes.data - base) // 4
        assert (owner[start:start + v.size] == 0).all()
        owner[start:start + v.size] = 1
    for layer, t in c.layers.items():
        c.staging_for(64, 2)
        m = np.array(c.meta(layer, 64)).tolist()
        assert len(m) == dt.META_STAGING + 2
        assert c.words[m[3]:m[3] + t.num_experts].ctypes.data == t.slot_of.ctypes.data
        assert m[0] == t.index and m[1] == len(layers) + t.index


def test_service_stops_promptly_when_idle():
    c = dt.ControlBlock({0: (8, 4)})
    svc = dt.MissService(c, lambda layer, experts: None)
    t = time.perf_counter()
    svc.close()
    assert time.perf_counter() - t < 1 and not svc._thread.is_alive()


def test_pinned_buffer_is_plain_memory_without_cuda():
    from moeflux_mlx.upload import PinnedBuffer

    b = PinnedBuffer(10000)
    assert b.array.size == 10000 and b.array.ctypes.data % 4096 == 0 and not b.array.any()
    b.array[:] = 7
    b.close()


def test_opt_in_and_needs_cuda(monkeypatch):
    monkeypatch.delenv("MOEFLUX_DEVICE_TABLE", raising=False)
    assert not dt.enabled()
    monkeypatch.setenv("MOEFLUX_DEVICE_TABLE", "1")
    assert dt.enabled() == dt.available()
    assert not dt.enabled(False)
