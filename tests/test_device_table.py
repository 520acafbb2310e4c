"""The device-side slot table's host protocol, run on the CPU.

The resolve and fill kernels are CUDA (test_kernels runs them on a GPU). Here a Python reference
of what they do stands in for them, operating on the same control block, while everything else
runs as shipped: the miss server process, the cache's table bookkeeping (``DeviceTable``, the
``TableBook`` of each of its layers), errors, and the synced path sharing the table during
prefill."""

import contextlib
import ctypes
import os
import re
import threading
import time

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import SwiGLU

import moeflux_mlx
from moeflux_mlx.cache.pool import IN_PLACE_BIT, InPlaceExperts, host_view
from moeflux_mlx.cache.whole_layer import OBSERVE_ROWS
from moeflux_mlx.compute.kernel_source import load_source
from moeflux_mlx.cuda import control_block as cb
from moeflux_mlx.cuda import pinned_files
from moeflux_mlx.cuda import runtime as cuda_runtime
from moeflux_mlx.cuda import table_kernels as tk
from moeflux_mlx.cuda.miss_client import MissServer
from moeflux_mlx.cuda.miss_server import within_slots
from moeflux_mlx.cuda.pinned_files import PinnedExperts
from moeflux_mlx.cuda.runtime import PinnedBuffer
from moeflux_mlx.cuda.table_cache import TableBook
from moeflux_mlx.errors import DeviceSetupError, DeviceWaitError, ExpertReadError
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.io.store import open_store
from moeflux_mlx.model.lookup_decoding import LookupStats, NgramIndex, lookup_generate_step
from moeflux_mlx.model.runtime import StreamingRuntime, use_table
from moeflux_mlx.options import LoadOptions, Tuning
from tests.support.tuning import tuned


def _wait_answer(control, i, seq, timeout=10):
    deadline = time.monotonic() + timeout
    while control.answers[i] != seq:  # the miss server process answers
        assert time.monotonic() < deadline, "the miss server never answered"
        time.sleep(1e-4)


ANSWER_LAG_S = 0.0  # how long the stand-in takes to read its slots again after looking (and asking)


def reference_resolve(
    control, staging, layer, indices, raw, layout, wait_s, after=None, in_place=0
):
    """What resolve_cuda.cuh + fill_cuda.cuh do, eagerly, from the main thread."""
    if after is not None:  # the kernel's edge: it runs after that computation
        mx.eval(after)
    t = control.layers[layer]
    i = t.index
    inds = np.array(indices).reshape(-1).astype(np.int64)
    calls = int(control.ticks[i]) + 1
    tick = calls + int(t.header["host_ticks"])
    seq = 0
    if (t.slot_of[inds] < 0).any():
        t.request[: inds.size] = inds
        t.header["nreq"] = inds.size
        seq = int(control.answers[i]) + 1
        control.requests[i] = seq
        _wait_answer(control, i, seq)
    time.sleep(ANSWER_LAG_S)
    slots = t.slot_of[inds].copy()  # read again, as the kernel does
    outside = (slots < 0) & bool(in_place)  # left out of the slots: read where it lies
    # an answer's slots stay until the call ends; a call that asked nothing may find a failed
    # read's slot freed since it looked (the kernel takes slot 0: that pass raises)
    assert (slots[~outside] >= 0).all() or (not seq and control.globals["errors"])
    slots = np.maximum(slots, 0)
    t.last_used[slots[~outside]] = tick
    if in_place == tk.IN_FILES:  # by expert id
        slots[outside] = IN_PLACE_BIT | inds[outside]
    elif in_place == tk.IN_STAGING:  # by staging row: after the misses, by id
        ncopy = int(t.header["ncopy"]) if seq else 0
        rank = np.searchsorted(np.unique(inds[outside]), inds[outside])
        slots[outside] = IN_PLACE_BIT | (ncopy + rank)
    control.ticks[i] = calls  # the end of resolve; fill, a kernel of its own, runs after
    if seq:
        n, poison = int(t.header["ncopy"]), bool(t.header["err"])
        rows = staging.array.reshape(-1, layout.blob_size)
        for k in range(n):
            for ci, c in enumerate(layout.components):
                dst = host_view(raw[c.name])[t.copy_dst[k]]
                if poison:
                    dst[:] = 0xFF
                elif t.sources is not None:  # pinned files: the copy list names experts
                    dst[:] = t.sources.rows[ci][t.copy_src[k]]
                else:
                    dst[:] = rows[t.copy_src[k], c.offset : c.offset + c.nbytes]
    return mx.array(slots.astype(np.uint32)).reshape(indices.shape)


def reference_hint(control, staging, layer, indices, predicted, wait_s):
    """What hint_cuda.cuh does, eagerly."""
    t = control.layers[layer]
    pred = np.array(predicted).reshape(-1)
    t.hint[: pred.size] = pred
    t.header["hint_n"] = pred.size
    t.header["hint_tick"] = control.ticks[t.index]
    control.hints[t.index] += 1
    return indices


@pytest.fixture(params=["reference", "cuda"])
def table_on_cpu(request, monkeypatch):
    """The Python reference of the kernels (anywhere), or the CUDA kernels themselves."""
    if request.param == "cuda":
        if not cuda_runtime.table_available():
            pytest.skip("the device-side table needs MLX's CUDA backend and libcudart")
        return  # on by default where it can run (Tuning.device_table None)
    monkeypatch.setattr(cuda_runtime, "table_available", lambda: True)
    monkeypatch.setattr(tk, "resolve", reference_resolve)
    monkeypatch.setattr(tk, "hint", reference_hint)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    src, packed = tiny_checkpoints["qwen3_moe"]
    model, tokenizer = mlx_lm.load(str(src))
    prompt = mx.array(tokenizer.encode("one two three four five six seven"))
    return packed, prompt, _greedy(model, prompt), expert_layout(packed).total_expert_bytes


def _greedy(model, prompt, n=24):
    return [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))]


def _load_streamed(packed, total, fraction=0.3, **options):
    """The model streaming from ``packed`` at ``fraction`` of its experts' bytes, pread, on the
    ops path (bit-exact with stock); ``options``: load options and ``Tuning`` fields. The expert
    files are read, not pinned, unless ``pin_experts`` says so (the machine would pin files
    this small, and these tests are about the reads)."""
    options.setdefault("pin_experts", False)
    return moeflux_mlx.load(
        packed,
        cache_budget=int(fraction * total),
        expert_io="pread",
        backend="ops",
        options=tuned(**options),
    )


@contextlib.contextmanager
def _emptied(path):
    """``path`` truncated to nothing within the block (reads of it fail), restored after."""
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.truncate(0)
    try:
        yield
    finally:
        with open(path, "r+b") as f:
            f.write(data)


def _pool_holds_the_right_experts(rt):
    """Every slot the table names holds exactly that expert's bytes from disk, one per slot."""
    if rt.cache.table is not None:  # fills run after the server's answers, on mlx-lm's stream
        rt.cache.table.synchronize()
    checked = 0
    for layer, pool in rt.cache.slots.pools.items():
        slot_of = rt.cache.slots.slot_of(layer)
        if slot_of is None:
            continue
        mx.eval(list(pool.raw.values()))
        experts = np.flatnonzero(slot_of >= 0)
        if not experts.size:
            continue
        slots = slot_of[experts]
        assert len(set(slots.tolist())) == slots.size, f"layer {layer}: two experts in one slot"
        blobs = rt.store.read(layer, experts)
        for c in pool.layout.components:
            got = np.array(pool.raw[c.name])[slots]
            assert (got == blobs[:, c.offset : c.offset + c.nbytes]).all(), (layer, c.name)
        checked += experts.size
    return checked


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_decode_through_the_table_is_exact(table_on_cpu, reference, fraction):
    packed, prompt, want, total = reference
    model, _ = _load_streamed(packed, total, fraction)
    with model.moeflux as rt:
        assert rt.cache.name == "table" and rt.stats_dict()["device_table"]
        assert _greedy(model, prompt) == want
        rt.stats_dict()  # folds in what the miss server read and the GPU's waits
        t = rt.stats.total()
        assert (
            t.unsynced_calls > 0 and t.calls > t.unsynced_calls
        )  # decode via the table, prefill synced
        assert 0 < t.experts_missed < t.experts_routed
        if tk.resolve is not reference_resolve:  # the CUDA kernel counts its waits
            assert 0 < t.gpu_waits <= t.unsynced_calls and t.gpu_wait_s > 0
        assert _pool_holds_the_right_experts(rt)
        assert (
            rt.cache.table.control.fault() is None and not rt.cache.table.control.globals["errors"]
        )
        rt.cache.check()


def _server_read_ns(rt) -> int:
    return sum(int(t.stats[cb.S_IO_NS]) for t in rt.cache.table.control.layers.values())


@pytest.mark.parametrize("source", ["packed", "plain"])
def test_pinned_files_decode_exactly_without_server_reads(
    table_on_cpu, reference, tiny_checkpoints, source, monkeypatch
):
    """pin_experts: the GPU copies each miss out of the page-locked expert files (a converted
    layer file, or a plain checkpoint's stacked tensors), and a prefill's whole layers too:
    tokens as stock's, every slot holding its expert, nothing read through the store, and the
    miss server only picking slots (its misses counted, no time reading)."""
    packed, prompt, want, total = reference
    path = packed if source == "packed" else tiny_checkpoints["qwen3_moe"][0]
    # a whole-layer prefill of the 7-token prompt
    model, _ = _load_streamed(path, total, pin_experts=True, prefill_whole_layer=1)
    with model.moeflux as rt:
        pinned = rt.cache.table.pinned
        assert pinned is not None and sorted(pinned.sources) == sorted(
            rt.cache.table.control.layers
        )
        reads = []
        read = rt.store.read
        monkeypatch.setattr(rt.store, "read", lambda *a, **k: reads.append(a) or read(*a, **k))
        assert _greedy(model, prompt) == want
        assert not reads  # the whole layers copied out of the pinned files, never read
        monkeypatch.setattr(rt.store, "read", read)
        rt.stats_dict()
        t = rt.stats.total()
        assert t.unsynced_calls > 0 and t.experts_missed > 0 and t.experts_read > 0
        assert sum(int(x.stats[cb.S_MISSED]) for x in rt.cache.table.control.layers.values()) > 0
        assert _server_read_ns(rt) == 0
        assert _pool_holds_the_right_experts(rt)
        rt.cache.check()
    assert not pinned.files  # unmapped (and unregistered) with the model


def test_pinning_without_the_table_says_so_and_pins_nothing(reference, caplog):
    """Where no layer goes through the device-side table (the CPU here) nothing is pinned, and
    the log says why instead of the option silently doing nothing."""
    packed, prompt, want, total = reference
    model, _ = _load_streamed(packed, total, pin_experts=True, device_table=False)
    with model.moeflux as rt:
        assert rt.cache.name != "table" and rt.cache.table is None
        assert _greedy(model, prompt) == want
    assert "pin_experts: no layer is looked up by the device-side table" in caplog.text


def test_pinned_rows_are_the_store_s_bytes(tiny_checkpoints):
    """Each pinned layer's rows, component by component, are the bytes the store reads."""
    for path in tiny_checkpoints["qwen3_moe"]:
        store, layout = open_store(path, "pread")
        pinned = PinnedExperts(store, layout.layers)
        try:
            for layer, src in pinned.sources.items():
                lay = store.layout(layer)
                blobs = store.read(layer, np.arange(lay.num_experts))
                for rows, c in zip(src.rows, lay.components):
                    assert (rows == blobs[:, c.offset : c.offset + c.nbytes]).all(), (path, c)
        finally:
            pinned.close()
            store.close()


def test_pinning_more_than_ram_allows_fails_clearly(tiny_store, monkeypatch):
    store, layout = tiny_store

    class Tiny:
        total = 1000

    monkeypatch.setattr(pinned_files.psutil, "virtual_memory", lambda: Tiny)
    with pytest.raises(DeviceSetupError, match=r"pin_experts: the expert files .* exceed 0.75"):
        PinnedExperts(store, layout.layers)


def test_pinning_is_the_machine_s_choice_where_the_files_fit(tiny_store, monkeypatch):
    """``pin_experts`` left to the machine pins where the files take at most half of RAM and
    fit in the memory available, and says which held."""
    store, layout = tiny_store
    size = sum(
        os.path.getsize(p)
        for p in {p for i in layout.layers for p, _, _ in store.component_runs(i)}
    )

    def memory(total, available):
        monkeypatch.setattr(
            pinned_files.psutil,
            "virtual_memory",
            lambda: type("Memory", (), {"total": total, "available": available}),
        )
        return pinned_files.pin_by_default(store, layout.layers)

    assert memory(2 * size, 2 * size) == (
        True,
        f"expert files {size / 1e9:.2f} GB <= 0.5 x RAM {2 * size / 1e9:.2f} GB",
    )
    pin, why = memory(2 * size - 1, 4 * size)
    assert not pin and "> 0.5 x RAM" in why
    pin, why = memory(4 * size, size)
    assert not pin and "> the memory available" in why


def test_pinned_layers_are_checked_against_their_checksums_once(tiny_checkpoints, tmp_path):
    """What the GPU copies out of pinned files never goes through the store's reads, so pinning
    checks every converted expert's CRC-32 at once: intact, nothing is left to check; one byte
    changed, the pinning fails naming the file, layer and expert, with nothing mapped."""
    import shutil

    from moeflux_mlx.errors import ExpertChecksumError

    _, packed = tiny_checkpoints["qwen3_moe"]
    store, layout = open_store(packed, "pread")
    try:
        pinned = PinnedExperts(store, layout.layers)
        pinned.close()
        assert not store._unchecked and store.checksum_cost()[1] == layout.total_expert_bytes
    finally:
        store.close()
    damaged = tmp_path / "damaged"
    shutil.copytree(packed, damaged)
    layer = sorted(layout.layers)[1]
    blob = layout.layers[layer].blob_size
    target = next((damaged / "packed_experts").glob(f"*{layer:02d}*"))
    with open(target, "r+b") as f:  # expert 3's first byte, same size
        f.seek(3 * blob)
        first = f.read(1)
        f.seek(3 * blob)
        f.write(bytes([first[0] ^ 0xFF]))
    store, layout = open_store(damaged, "pread")
    try:
        with pytest.raises(ExpertChecksumError, match=f"layer {layer}, expert 3"):
            PinnedExperts(store, layout.layers)
    finally:
        store.close()


def test_a_failure_while_pinning_leaves_nothing_mapped(tiny_store, monkeypatch):
    """A layer that cannot be described after its files were mapped (and, on CUDA, registered)
    fails the pinning in one error, with every file closed again."""
    store, layout = tiny_store
    closed = []
    close = pinned_files._PinnedFile.close
    monkeypatch.setattr(pinned_files._PinnedFile, "close", lambda f: closed.append(f) or close(f))

    def bad_rows(*a):
        raise DeviceSetupError("an expert file holds 1 bytes, 2 needed")

    monkeypatch.setattr(pinned_files, "_rows", bad_rows)
    with pytest.raises(DeviceSetupError, match="holds 1 bytes"):
        PinnedExperts(store, layout.layers)
    assert closed and all(f.array.size == 0 for f in closed)


def test_the_server_names_experts_and_reads_nothing_for_pinned_layers(tiny_store, monkeypatch):
    """For a layer the GPU copies from pinned files the copy list's sources are the missed
    experts themselves, and the server answers without reading (its files could vanish)."""
    store, layout = tiny_store
    c0 = min(layout.layers)
    server = _server(store, layout, in_place=[c0])
    try:
        c, layer, t, _ = _first_layer(server, layout, rows=4)
        assert layer == c0
        assert _gpu_call(c, layer, [3, 7, 9])
        n = int(t.header["ncopy"])
        assert n == 3 and sorted(t.copy_src[:n].tolist()) == [3, 7, 9]
        for k in range(n):
            assert t.slot_of[t.copy_src[k]] == t.copy_dst[k]
        assert t.stats[cb.S_MISSED] == 3 and t.stats[cb.S_IO_NS] == 0
        assert t.stats[cb.S_BYTES] == 3 * layout.layers[layer].blob_size
    finally:
        server.close()


def _speculate(model, tokenizer, rt):
    """Prompt-lookup decoding of a repetitive prompt (passes of 3-5 tokens) after a synced
    prefill, checked against plain decoding: the same tokens (and, on the CPU, log-probs);
    returns the counters of the lookup decoding alone."""
    prompt = mx.array(tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3))
    want = [
        (int(t), lp) for (t, lp), _ in zip(generate_step(prompt, model, max_tokens=24), range(24))
    ]
    cache = make_prompt_cache(model)
    model(prompt[None, :-1], cache=cache)  # the prefill: synced
    mx.eval([c.state for c in cache])
    rt.reset_stats()
    stats = LookupStats()
    got = list(
        lookup_generate_step(
            prompt[-1:],
            model,
            num_draft_tokens=4,
            max_tokens=24,
            prompt_cache=cache,
            context=prompt[:-1].tolist(),
            stats=stats,
        )
    )
    assert [t for t, *_ in got] == [t for t, _ in want]
    if mx.default_device() == mx.cpu:  # a GPU rounds a batch's rows unlike one row's
        for (_, g, _), (_, w) in zip(got, want):
            assert mx.array_equal(g, w).item()
    assert stats.proposed > 0 and stats.steps < 24
    rt.stats_dict()
    t = rt.stats.total()
    assert t.calls == t.unsynced_calls  # no host sync, passes included
    assert _pool_holds_the_right_experts(rt)
    assert rt.cache.table.control.fault() is None and not rt.cache.table.control.globals["errors"]
    return t


def test_a_request_beyond_the_slots_keeps_the_resident_then_the_earliest_absent():
    """A pass naming more experts than the slots (pinned files): every resident one keeps its
    slot, the absent ones fill the rest in the order the request names them, and the others are
    read in place; duplicates count once."""
    slot_of = np.full(10, -1)
    slot_of[[4, 7]] = [0, 1]
    request = np.array([9, 4, 2, 9, 7, 5, 1, 2])  # tokens' selections, in order
    kept, outside = within_slots(request, slot_of, 4)
    assert kept.tolist() == [2, 4, 7, 9] and outside.tolist() == [5, 1]
    kept, outside = within_slots(request, slot_of, 2)  # the slots hold the resident alone
    assert kept.tolist() == [4, 7] and outside.tolist() == [9, 2, 5, 1]


def test_speculative_passes_go_through_the_table_a_token_at_a_time(
    table_on_cpu, reference, monkeypatch
):
    """Prompt-lookup passes of 3-5 tokens at a budget whose slots (4 of 16 experts, top-4) their
    union outgrows, with a staging of two tokens' misses (as for experts too large for a
    pass's): served by the table a token at a time, with no host sync, the union announced to
    the miss server by the first token and read ahead; tokens and log-probs as plain
    decoding's."""
    packed, _, _, total = reference
    monkeypatch.setattr(tk, "PASS_STAGING_BYTES", 0)
    model, tokenizer = _load_streamed(packed, total)
    with model.moeflux as rt:
        t = _speculate(model, tokenizer, rt)
        assert t.calls == t.tokens  # every call of one token: the passes went token by token
        assert t.experts_missed > 0 and t.prefetch_issued > 0  # the union, read ahead


@pytest.mark.parametrize("pinned", [False, True])
def test_passes_outgrowing_the_slots_are_one_call_the_rest_read_in_place(
    table_on_cpu, reference, monkeypatch, pinned
):
    """The same passes, with a staging that holds a pass's misses, or with pinned expert files,
    are one table call a layer: the server admits what the 4 slots hold, resident experts first,
    and the expert computation reads the rest of the union where it lies (``InPlaceExperts``:
    the staging the server read it into, or the files); tokens as plain decoding's."""
    packed, _, _, total = reference
    outside = []
    gathered = InPlaceExperts.gathered

    def counting(self, pool, slots):
        out = gathered(self, pool, slots)
        outside.append(int((np.array(slots).astype(np.int64) & IN_PLACE_BIT != 0).sum()))
        return out

    monkeypatch.setattr(InPlaceExperts, "gathered", counting)
    # plain ops (exact everywhere) read them after a host sync, which the kernels do not need
    monkeypatch.setattr(StreamingRuntime, "reads_outside", lambda *a: True)
    model, tokenizer = _load_streamed(packed, total, pin_experts=pinned)
    with model.moeflux as rt:
        layers = sorted(rt.cache.table.control.layers)
        assert sorted(rt.cache.table.in_place) == (layers if pinned else [])
        t = _speculate(model, tokenizer, rt)
        assert t.calls < t.tokens  # passes went whole
        assert outside and sum(outside) > 0  # some experts were read where they lie
        assert t.experts_missed > 0
        if not pinned:
            assert sorted(rt.cache.table._in_staging) == layers


def test_passes_outgrowing_the_slots_go_a_token_at_a_time_where_plain_ops_compute(
    table_on_cpu, reference
):
    """Plain ops would read experts outside the pool only after a host sync, so with them a
    pass larger than the slots goes a token at a time; only the fused CUDA kernels, where they
    take the layer, read such experts as they run (``reads_outside``)."""
    packed, _, _, total = reference
    model, tokenizer = _load_streamed(packed, total)
    with model.moeflux as rt:
        x = mx.zeros((1, 3, 64), mx.float32)
        assert not rt.reads_outside(min(rt.layout.layers), x, mx.zeros((1, 3, 4)), SwiGLU())
        t = _speculate(model, tokenizer, rt)
        assert t.calls == t.tokens


@pytest.mark.parametrize("pass_staging", [True, False])
def test_a_short_call_goes_through_the_table_only_while_verifying_drafts(
    table_on_cpu, reference, monkeypatch, pass_staging
):
    """Outside speculation a three-token call is computed whole, as stock computes it (one host
    sync a layer); within ``verifying_drafts`` the table takes it: as one call a layer where
    the staging holds a pass's misses, else a token at a time."""
    packed, _, _, total = reference
    if not pass_staging:
        monkeypatch.setattr(tk, "PASS_STAGING_BYTES", 0)
    monkeypatch.setattr(StreamingRuntime, "reads_outside", lambda *a: True)
    model, _ = _load_streamed(packed, total)
    x = mx.array([[17, 3, 41]])
    with model.moeflux as rt:
        mx.eval(model(x))
        rt.stats_dict()
        whole = rt.stats.total()
        assert whole.unsynced_calls == 0 and whole.tokens == 3 * whole.calls
        rt.reset_stats()
        with rt.verifying_drafts():
            out = model(x)
        assert not rt.verifying
        mx.eval(out)
        rt.stats_dict()
        table = rt.stats.total()
        assert table.unsynced_calls == table.calls and table.tokens == 3 * whole.calls
        assert table.calls == (whole.calls if pass_staging else table.tokens)


@pytest.mark.parametrize("pinned", [False, True])
def test_a_pass_whose_selections_fit_the_slots_is_one_table_call(table_on_cpu, reference, pinned):
    """A speculative pass whose tokens' selections all fit a layer's slots (and what one answer
    copies: the staging's rows, or with pinned files the copy list) is one table call a layer,
    its union admitted at once, with the logits of the same call computed outside speculation."""
    packed, _, _, total = reference
    # top-4: 2 tokens fit the staging's 8 rows; pinned, 3 tokens fit the copy list
    x = mx.array([[17, 3, 41]]) if pinned else mx.array([[17, 3]])
    model, _ = _load_streamed(packed, total, 0.8, pin_experts=pinned)
    with model.moeflux as rt:
        want = model(x)
        mx.eval(want)
        rt.stats_dict()
        outside = rt.stats.total()
        assert outside.unsynced_calls == 0  # outside speculation: the synced path
        rt.reset_stats()
        with rt.verifying_drafts():
            got = model(x)
        mx.eval(got)
        rt.stats_dict()
        whole = rt.stats.total()
        assert whole.unsynced_calls == whole.calls == outside.calls  # one call a layer
        assert whole.tokens == x.size * whole.calls
        assert mx.array_equal(got, want).item()
        rt.cache.check()


@pytest.mark.parametrize("eviction", ["lru", "transition"])
def test_same_misses_as_the_synced_cache(table_on_cpu, reference, eviction):
    """The table path and the host-synced path make the same LRU decisions; a counting policy
    (transition, the default) sees the GPU's uses through its last-use records, at most one per slot between
    two of its layer's misses, so its misses may differ a little from the synced path's."""
    packed, prompt, _, total = reference
    missed = []
    tokens = []
    for table in (True, False):
        model, _ = moeflux_mlx.load(
            packed,
            options=tuned(device_table=table, eviction=eviction),
            cache_budget=int(0.3 * total),
        )
        with model.moeflux as rt:
            assert (rt.cache.name == "table") == table
            if table:  # the synced path's bookkeeping of these layers is the server's
                assert all(isinstance(b, TableBook) for b in rt.cache.slots.books.values())
            tokens.append(_greedy(model, prompt))  # default backend: the kernels on a GPU
            rt.stats_dict()
            missed.append({i: s.experts_missed for i, s in rt.stats.layers.items()})
    assert tokens[0] == tokens[1]
    if eviction == "lru":
        assert missed[0] == missed[1]
    else:
        table_total, synced_total = sum(missed[0].values()), sum(missed[1].values())
        assert abs(table_total - synced_total) <= 0.1 * synced_total


def test_lazy_calls_mixing_table_and_synced_paths_stay_exact(
    table_on_cpu, reference, tiny_checkpoints
):
    """Forward passes built and left unevaluated while others run: one-token passes (through the
    table, evaluated last) around a multi-token one (synced, whose admissions evict and rewrite
    slots), at a budget small enough to evict. Each must see its own experts."""
    if tk.resolve is reference_resolve:
        pytest.skip(
            "the Python stand-in looks up and fills when the graph is built; only the "
            "kernels do it in stream order, which this test is about"
        )
    packed, _, _, total = reference
    ref = mlx_lm.load(str(tiny_checkpoints["qwen3_moe"][0]))[0]
    model, _ = _load_streamed(packed, total)
    xs = [
        mx.array([[5]]),
        mx.array([[250, 7, 7, 120, 64, 33, 2]]),
        mx.array([[99]]),
        mx.array([[17, 3, 41]]),
        mx.array([[64]]),
    ]
    with model.moeflux as rt:
        outs = [model(x) for x in xs]
        mx.eval(outs)
        for x, out in zip(xs, outs):
            assert mx.array_equal(out, ref(x)).item(), x.tolist()
        rt.stats_dict()
        assert rt.stats.total().unsynced_calls > 0  # the one-token passes used the table
        assert _pool_holds_the_right_experts(rt)


def test_failed_read_raises_at_the_next_call_then_recovers(table_on_cpu, reference):
    """A read the miss server cannot do (the layer file truncated under it) poisons the slots
    it was filling, raises an error naming the file at the next call, and frees those slots;
    once the file is back, generation is exact again."""
    packed, prompt, want, total = reference
    model, _ = _load_streamed(packed, total)
    layer0 = min(expert_layout(packed).layers)
    path = packed / "packed_experts" / f"layer_{layer0:02d}.bin"
    with model.moeflux as rt:
        # a one-token prompt: no synced prefill, the very first call goes through the table
        with _emptied(path):
            with pytest.raises(ExpertReadError, match=f"layer_{layer0:02d}.bin.*layer {layer0}"):
                _greedy(model, prompt[:1], n=4)
        assert not rt.cache.table.control.globals["pending_release"]
        _pool_holds_the_right_experts(rt)  # the poisoned slots were freed
        rt.cache.check()  # the error was reported once
        assert _greedy(model, prompt) == want
        assert _pool_holds_the_right_experts(rt)


@pytest.mark.parametrize("slow", [False, True])
def test_failed_read_in_a_speculative_pass_yields_none_of_its_tokens(
    table_on_cpu, reference, slow, request, monkeypatch
):
    """Prompt lookup through the table: a pass whose reads failed (poisoned slots) raises the
    error naming the file before yielding any token it computed. ``slow``: a server that polls
    seldom and a GPU slow to read its answer, so that a later call of the pass hits a poisoned
    slot and asks for its other experts before the failed call's slots are freed: they must
    stay until the answer has been read."""
    if slow:
        if "cuda" in request.node.callspec.id:
            pytest.skip("the lag is the Python stand-in's")
        monkeypatch.setitem(globals(), "ANSWER_LAG_S", 0.01)
    packed, prompt, _, total = reference
    polls = dict(server_poll_us=20000, server_poll_max_us=20000) if slow else {}
    model, _ = _load_streamed(packed, total, **polls)
    layer0 = min(expert_layout(packed).layers)
    got = []
    ids = prompt.tolist()
    drafts = NgramIndex(1, 3)
    drafts.extend(ids + ids[:1])
    assert drafts.draft(3)  # the last token seen before, with what followed: the pass drafts
    with model.moeflux, _emptied(packed / "packed_experts" / f"layer_{layer0:02d}.bin"):
        with pytest.raises(ExpertReadError, match=f"layer_{layer0:02d}.bin"):
            steps = lookup_generate_step(
                mx.array(ids[:1]), model, context=ids, max_tokens=4, num_draft_tokens=3
            )
            for step in steps:
                got.append(step)
    assert got == []


def test_gpu_fault_raises(table_on_cpu, reference):
    packed, _, _, total = reference
    model, _ = moeflux_mlx.load(packed, cache_budget=int(0.3 * total))
    with model.moeflux as rt:
        control = rt.cache.table.control
        control.faults[0] = cb.FAULT_TIMEOUT
        with pytest.raises(DeviceWaitError, match=f"layer {control.order[0]}.*waited"):
            rt.cache.check()
        control.faults[0] = cb.FAULT_INDEX
        with pytest.raises(DeviceWaitError, match="out of range"):
            rt.cache.check()
        control.faults[0] = 0


def test_control_block_regions_do_not_overlap():
    layers = {1: (128, 40), 3: (64, 64 - 1), 4: (256, 8), 6: (512, 100)}
    c = cb.ControlBlock(layers, allocate=PinnedBuffer)
    owner = np.zeros(c.buffer.array.size, np.int64)
    base = c.buffer.array.ctypes.data
    views = [c.globals, c.message] + [getattr(c, v) for v in cb.VECTORS]
    for t in c.layers.values():
        views += [
            t.header,
            t.slot_of,
            t.last_used,
            t.request,
            t.copy_src,
            t.copy_dst,
            t.host_request,
            t.host_missing,
            t.host_victims,
            t.hint,
            t.stats,
        ]
        assert t.slot_of.size == t.num_experts and t.last_used.size == t.n_slots
        assert t.host_request.size >= t.n_slots and t.request.size == cb.MAX_SELECTIONS
        assert (t.slot_of == -1).all() and (t.last_used == -1).all()
    for v in views:
        start = v.ctypes.data - base
        assert (owner[start : start + v.nbytes] == 0).all()
        owner[start : start + v.nbytes] = 1
    staging = PinnedBuffer(128)
    for layer, t in c.layers.items():
        m = np.array(tk._meta(c, staging, layer)).tolist()
        assert len(m) == cb.META_HINT + 2
        assert c.words[m[cb.META_HINT] :].ctypes.data == c.hints[t.index :].ctypes.data
        assert c.words[m[cb.META_HINT + 1] :].ctypes.data == t.hint.ctypes.data
        assert c.words[m[3] : m[3] + t.num_experts].ctypes.data == t.slot_of.ctypes.data
        assert c.words[m[0] :].ctypes.data == c.requests[t.index :].ctypes.data
        assert c.words[m[10] :].ctypes.data == c.ticks[t.index :].ctypes.data
    # a second mapping of the same memory (what the miss server sees) shares every word
    other = cb.ControlBlock(layers, fd=os.dup(c.fd))
    other.layers[4].slot_of[7] = 3
    assert c.layers[4].slot_of[7] == 3 and (other.layers[1].slot_of == -1).all()
    other.close()
    staging.close()
    c.close()


def _first_layout(layers):
    """The control block as it was first laid out, by offset arithmetic (in int32 words; the
    stats and the message in bytes), restated here: the kernels were written against it, so a
    change to control_block's dtypes must be a deliberate one."""
    order, nl = sorted(layers), len(layers)
    vectors = {name: 16 + k * nl for k, name in enumerate(cb.VECTORS)}
    size = (16 + 8 * nl + 15) // 16 * 16
    regions = {}
    for layer in order:
        e, s = layers[layer]
        r = max(64, s)
        b = size
        tab = b + 12
        last = tab + e
        reqi = last + s
        csrc = reqi + 64
        cdst = csrc + 64
        hreq = cdst + 64
        hmiss = hreq + r + 1024
        hvic = hmiss + r
        hint = hvic + r
        regions[layer] = {
            "header": (b, 12),
            "slot_of": (tab, e),
            "last_used": (last, s),
            "request": (reqi, 64),
            "copy_src": (csrc, 64),
            "copy_dst": (cdst, 64),
            "host_request": (hreq, r + 1024),
            "host_missing": (hmiss, r),
            "host_victims": (hvic, r),
            "hint": (hint, 64),
        }
        size += (12 + e + s + 4 * 64 + 3 * r + 1024 + 15) // 16 * 16
    stats_at = (size * 4 + 7) // 8 * 8
    message_at = stats_at + 8 * 6 * nl
    return vectors, regions, stats_at, message_at, message_at + 4096


def test_control_block_layout_is_the_one_the_kernels_were_written_for():
    """Every region of the block where the first, offset-arithmetic layout put it, and the
    named words (header, globals, meta) at the indices they had."""
    assert cb.HEADER.names == (
        "err", "nreq", "ncopy", "waits", "wait_us", "host_kind", "host_n", "host_nmiss",
        "host_ticks", "hint_n", "hint_tick", "host_k",
    )  # fmt: skip
    assert [cb.HEADER.fields[n][1] for n in cb.HEADER.names] == [4 * k for k in range(12)]
    assert cb.HEADER.itemsize == 4 * cb.HEADER_WORDS == 48
    assert (cb.H_ERR, cb.H_NREQ, cb.H_NCOPY, cb.H_WAITS, cb.H_WAIT_US) == (0, 1, 2, 3, 4)
    assert (cb.H_HOST_KIND, cb.H_HOST_N, cb.H_HOST_NMISS, cb.H_HOST_TICKS) == (5, 6, 7, 8)
    assert (cb.H_HINT_N, cb.H_HINT_TICK, cb.H_HOST_K) == (9, 10, 11)
    assert (cb.G_STOP, cb.G_READY, cb.G_ERRORS, cb.G_PENDING_RELEASE) == (0, 1, 2, 3)
    assert cb.GLOBALS.itemsize == 4 * cb.GLOBAL_WORDS == 64
    assert (cb.META_CTRL, cb.META_STAGING, cb.META_HINT, cb.META_SOURCES) == (11, 13, 15, 17)
    for layers in ({1: (128, 40), 3: (64, 63), 4: (256, 8), 6: (512, 100)}, {0: (8, 8)}):
        c = cb.ControlBlock(layers)
        try:
            base = c.buffer.array.ctypes.data
            vectors, regions, stats_at, message_at, nbytes = _first_layout(layers)
            assert c.dtype.itemsize == nbytes and c.buffer.nbytes == nbytes
            assert c.globals.ctypes.data == base and c.globals.nbytes == 64
            for name, at in vectors.items():
                v = getattr(c, name)
                assert v.dtype == np.int32 and v.size == len(layers)
                assert v.ctypes.data - base == 4 * at, name
            for layer, t in c.layers.items():
                for name, (at, n) in regions[layer].items():
                    v = getattr(t, name)
                    assert v.ctypes.data - base == 4 * at and v.nbytes == 4 * n, (layer, name)
                    assert v.dtype == cb.HEADER if name == "header" else v.dtype == np.int32
                assert t.stats.ctypes.data - base == stats_at + 48 * t.index
                w = t.words
                assert (w.base, w.tab, w.last, w.reqi, w.csrc, w.cdst, w.hint) == tuple(
                    regions[layer][k][0]
                    for k in "header slot_of last_used request copy_src copy_dst hint".split()
                )
                i = t.index
                assert (w.req_at, w.done_at, w.fault_at, w.tick_at, w.hseq) == (
                    vectors["requests"] + i,
                    vectors["answers"] + i,
                    vectors["faults"] + i,
                    vectors["ticks"] + i,
                    vectors["hints"] + i,
                )
                assert w.n_experts == t.num_experts
            assert c.message.ctypes.data - base == message_at and c.message.nbytes == 4096
        finally:
            c.close()


def _meta_reads(text):
    """``{name: word}`` of every ``name = meta[word]`` in a kernel's text (``MF_META_HINT``
    resolved), and ``{name: MF_META_*}`` of every ``name = mf_ptr<...>(meta, MF_META_*)``."""
    words = {
        name: cb.META_HINT + int(plus or 0) if at == "MF_META_HINT" else int(at)
        for name, at, plus in re.findall(r"(\w+) = meta\[(MF_META_HINT|\d+)(?: \+ (\d+))?\]", text)
    }
    pointers = dict(re.findall(r"(\w+) = mf_ptr<[^>]+>\(meta, MF_META_(\w+)\)", text))
    return words, pointers


def test_the_kernels_read_meta_and_the_header_where_control_block_puts_them():
    """What resolve/fill/hint_cuda.cuh read by position is the ``META`` field of that name, and
    each ``MF_H_*`` they use is compiled in as its ``HEADER`` field's word: a change on either
    side fails here."""
    header = tk._header(1.0)
    defines = {k: int(v) for k, v in re.findall(r"#define MF_(\w+) (\d+)\n", header)}
    seen = set()
    for name in ("resolve_cuda.cuh", "fill_cuda.cuh", "hint_cuda.cuh"):
        text = load_source(name)
        words, pointers = _meta_reads(text)
        assert words, name
        for var, at in words.items():
            dt, offset = cb.META.fields[var][:2]
            assert offset == 4 * at and dt == np.dtype("<i4"), (name, var)
            seen.add(var)
        for var, which in pointers.items():
            field = {"CTRL": "ctrl", "STAGING": "staging"}[which]
            dt, offset = cb.META.fields[field][:2]
            assert dt == np.dtype("<u8") and offset == 4 * defines[f"META_{which}"], (name, var)
            seen.add(field)
        for h in re.findall(r"MF_H_(\w+)", text):
            assert defines[f"H_{h}"] == cb.HEADER.fields[h.lower()][1] // 4, (name, h)
    assert defines["META_HINT"] == cb.META_HINT and defines["MAXN"] == cb.MAX_SELECTIONS
    assert seen == set(cb.META.names)  # every named word of meta is read by some kernel
    # with pinned files each component's address follows, lo then hi word (fill's sources)
    c = cb.ControlBlock({2: (16, 4)})
    try:
        t = c.layers[2]
        m = t.words.meta((7 << 32) | 5, (9 << 32) | 3, [(11 << 32) | 13]).tolist()
        assert m[cb.META_CTRL : cb.META_CTRL + 2] == [5, 7]
        assert m[cb.META_STAGING : cb.META_STAGING + 2] == [3, 9]
        assert m[cb.META_SOURCES :] == [13, 11]
        assert m[3] == t.words.tab and m[8] == 16 and m[cb.META_HINT + 1] == t.words.hint
    finally:
        c.close()


@pytest.fixture
def tiny_store(tiny_checkpoints):
    _, packed = tiny_checkpoints["qwen3_moe"]
    store, layout = open_store(packed, "pread")
    yield store, layout
    store.close()


def _server(store, layout, n_slots=4, poll_us=None, in_place=()):
    control = cb.ControlBlock(
        {i: (lay.num_experts, n_slots) for i, lay in layout.layers.items()}, allocate=PinnedBuffer
    )
    o = Tuning()
    return MissServer(
        control,
        store,
        o.wait_timeout_s,
        poll_us or o.server_poll_us,
        poll_us or o.server_poll_max_us,
        in_place=in_place,
    )


def _until(what, timeout=10):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(1e-3)


def _first_layer(server, layout, rows):
    """(control block, the first table layer, its words, a staging of ``rows`` rows for it)."""
    c = server.control
    layer = c.order[0]
    blob = layout.layers[layer].blob_size
    return c, layer, c.layers[layer], server.staging_for(blob, rows).array.reshape(-1, blob)


def _gpu_call(control, layer, experts) -> bool:
    """What resolve_cuda.cuh does for a call of ``experts``, enqueued by the host: a request
    when one is absent, answered by the miss server; then the call ends. Whether it asked."""
    t = control.layers[layer]
    i = t.index
    control.expected[i] += 1
    asked = bool((t.slot_of[experts] < 0).any())
    if asked:
        seq = int(control.answers[i]) + 1
        t.request[: len(experts)] = experts
        t.header["nreq"] = len(experts)
        control.requests[i] = seq
        _wait_answer(control, i, seq)
        assert not t.header["err"]
    control.ticks[i] += 1
    return asked


def test_hints_are_read_ahead_and_taken_by_the_next_request(tiny_store):
    """Prefetch on the table path: the server reads a hint's absent experts ahead, the layer's
    next request takes those bytes (set-based), and a newer hint replaces an older one."""
    store, layout = tiny_store
    server = _server(store, layout)
    try:
        c, layer, t, staging = _first_layer(server, layout, rows=4)

        def publish_hint(experts):
            reference_hint(
                c,
                None,
                layer,
                mx.array(np.array([0], np.uint32)),
                mx.array(np.array(experts, np.uint32)),
                wait_s=5.0,
            )

        publish_hint([9])
        _until(lambda: t.stats[cb.S_PF_ISSUED] == 1)
        publish_hint([3, 5])  # replaces [9]
        _until(lambda: t.stats[cb.S_PF_ISSUED] == 3)
        assert _gpu_call(c, layer, [3, 7, 9])
        assert t.stats[cb.S_MISSED] == 3 and t.stats[cb.S_PF_HITS] == 1  # 3 only: 9 was replaced
        n = int(t.header["ncopy"])
        assert n == 3
        expert_in = {int(t.slot_of[e]): e for e in (3, 7, 9)}
        for k in range(n):
            e = expert_in[int(t.copy_dst[k])]
            assert (staging[t.copy_src[k]] == store.read(layer, np.array([e]))[0]).all(), e
    finally:
        server.close()


def test_a_pass_hint_covers_its_tokens_calls_then_goes(tiny_store):
    """A speculative pass's hint (every token's experts, as ``DeviceTable.plan_pass`` publishes it):
    its absent experts are read ahead for the pass's calls, its resident ones are kept through
    the earlier tokens' misses, and what its last call did not take is dropped."""
    store, layout = tiny_store
    server = _server(store, layout, n_slots=4)
    try:
        c, layer, t, _ = _first_layer(server, layout, rows=2)

        def call(experts):
            assert _gpu_call(c, layer, experts)  # every call here misses

        call([0, 1])
        call([2, 3])  # 0 is now the least recently used slot
        reference_hint(
            c, None, layer, mx.array(np.array([5, 6], np.uint32)), mx.array([5, 6, 0, 9]), 5.0
        )  # two tokens of top-2: 5 6, then 0 9
        _until(lambda: t.stats[cb.S_PF_ISSUED] == 3)  # 5, 6, 9: 0 is resident
        call([5, 6])
        assert t.slot_of[0] >= 0  # kept for the next token, though least recently used
        assert t.stats[cb.S_PF_HITS] == 2
        call([0, 4])  # the pass's last call, routed otherwise than drafted: 9 is not taken
        assert t.stats[cb.S_PF_HITS] == 2
        # its read of 9 went with the last call: a new hint naming 9 reads it again
        reference_hint(c, None, layer, mx.array(np.array([9], np.uint32)), mx.array([9]), 5.0)
        _until(lambda: t.stats[cb.S_PF_ISSUED] == 4)
        call([9, 1])
        assert t.stats[cb.S_PF_HITS] == 3 and t.stats[cb.S_READ] == 2 + 2 + 2 + 1 + 2
    finally:
        server.close()


def test_a_pass_token_s_request_admits_the_next_tokens_experts_that_fit(tiny_store):
    """A pass's token that misses also admits the next tokens' experts while their union fits
    the slots and the staging: those tokens then find every expert resident."""
    store, layout = tiny_store
    server = _server(store, layout, n_slots=4)
    try:
        c, layer, t, staging = _first_layer(server, layout, rows=4)

        def call(experts):
            return _gpu_call(c, layer, experts)

        call([0, 1])
        call([2, 3])
        words = [5, 6, 0, 9, 7, 8]  # three tokens; the first two's union {0, 5, 6, 9} fits
        reference_hint(c, None, layer, mx.array(np.array(words[:2], np.uint32)), mx.array(words), 5)
        _until(lambda: t.stats[cb.S_PF_ISSUED] == 5)
        assert call([5, 6])
        assert (t.slot_of[[0, 5, 6, 9]] >= 0).all() and t.stats[cb.S_PF_HITS] == 3
        assert not call([0, 9])  # the second token: resident already
        assert call([7, 8])  # the third did not fit with them: its own request, read ahead
        assert t.stats[cb.S_PF_HITS] == 5 and t.stats[cb.S_READ] == 2 + 2 + 3 + 2
        for k in range(int(t.header["ncopy"])):  # the copy list holds the right bytes
            e = int(np.flatnonzero(t.slot_of == t.copy_dst[k])[0])
            assert (staging[t.copy_src[k]] == store.read(layer, np.array([e]))[0]).all()
    finally:
        server.close()


def test_a_failed_read_frees_the_later_tokens_experts_at_once(tiny_store, tiny_checkpoints):
    """A pass's request that admitted the next token's experts too, and whose reads failed: the
    call's own poisoned slots are freed once the GPU is past it, the next token's at once (it
    must ask for them again, not compute on poisoned slots)."""
    store, layout = tiny_store
    server = _server(store, layout, n_slots=4)
    c, layer, t, _ = _first_layer(server, layout, rows=4)
    path = tiny_checkpoints["qwen3_moe"][1] / "packed_experts" / f"layer_{layer:02d}.bin"
    try:
        assert _gpu_call(c, layer, [0, 1]) and _gpu_call(c, layer, [2, 3])
        with _emptied(path):
            reference_hint(
                c, None, layer, mx.array(np.array([5, 6], np.uint32)), mx.array([5, 6, 0, 9]), 5.0
            )
            t.request[:2] = [5, 6]
            t.header["nreq"] = 2
            seq = int(c.answers[t.index]) + 1
            c.requests[t.index] = seq
            _wait_answer(c, t.index, seq)
        assert t.header["err"] and int(t.header["ncopy"]) == 3  # 5, 6 and 9 poisoned
        assert t.slot_of[9] < 0  # the next token's: freed at once
        assert t.slot_of[5] >= 0 and t.slot_of[6] >= 0  # this call's: it still reads them
        c.ticks[t.index] += 1  # the GPU is past the call
        _until(lambda: c.globals["pending_release"] == 0)  # counted down once freed
        assert t.slot_of[5] < 0 and t.slot_of[6] < 0
        assert t.slot_of[0] >= 0  # resident before, untouched
    finally:
        server.close()


def _failed_gpu_request(control, layer, experts, path):
    """A GPU call of ``experts`` whose reads fail (``path`` emptied), answered; not yet ended."""
    t = control.layers[layer]
    with _emptied(path):
        control.expected[t.index] += 1
        t.request[: len(experts)] = experts
        t.header["nreq"] = len(experts)
        seq = int(control.answers[t.index]) + 1
        control.requests[t.index] = seq
        _wait_answer(control, t.index, seq)
    assert t.header["err"] and control.globals["pending_release"] == 1


def test_a_synced_admit_after_a_failed_call_reads_its_experts_again(tiny_store, tiny_checkpoints):
    """The GPU is past a call whose reads failed, and the host, synced, admits the same experts
    before the server's loop has freed their poisoned slots (it polls seldom): the admit frees
    them first and reads them, instead of counting them resident."""
    store, layout = tiny_store
    server = _server(store, layout, poll_us=200_000)
    c, layer, t, _ = _first_layer(server, layout, rows=4)
    path = tiny_checkpoints["qwen3_moe"][1] / "packed_experts" / f"layer_{layer:02d}.bin"
    try:
        _failed_gpu_request(c, layer, [5, 6], path)
        c.ticks[t.index] += 1  # the call ends; the host syncs and admits the same experts
        missing, victims = server.host_request(layer, cb.HOST_ADMIT, np.array([5, 6]))
        assert sorted(missing.tolist()) == [5, 6] and (t.slot_of[[5, 6]] >= 0).all()
        assert c.globals["pending_release"] == 0
    finally:
        server.close()


def test_check_raises_a_failed_read_once_its_slots_are_freed(tiny_store, tiny_checkpoints):
    """``check`` while the failed call still runs (on CUDA the next pass is built meanwhile;
    here longer than the 2 s it once waited at most): it raises only once the call has ended
    and its poisoned slots are freed, so that a retry finds none of them."""
    store, layout = tiny_store
    server = _server(store, layout)
    c, layer, t, _ = _first_layer(server, layout, rows=4)
    path = tiny_checkpoints["qwen3_moe"][1] / "packed_experts" / f"layer_{layer:02d}.bin"
    try:
        _failed_gpu_request(c, layer, [5, 6], path)
        ends = threading.Timer(2.5, lambda: c.ticks.__setitem__(t.index, c.ticks[t.index] + 1))
        ends.start()
        with pytest.raises(ExpertReadError, match=f"layer_{layer:02d}.bin"):
            server.check()
        assert (t.slot_of[[5, 6]] < 0).all() and c.globals["pending_release"] == 0
        ends.join()
    finally:
        server.close()


def test_server_answers_while_this_process_holds_the_gil(tiny_store):
    """The reason the miss server is a process: MLX may block this process's thread inside a
    call that holds the GIL (mx.async_eval) while the GPU waits. A request published before such
    a block is answered during it."""
    store, layout = tiny_store
    server = _server(store, layout)
    try:
        c = server.control
        layer = c.order[0]
        t = c.layers[layer]
        server.staging_for(layout.layers[layer].blob_size, 4)
        t.request[:2] = [3, 5]
        t.header["nreq"] = 2
        c.requests[t.index] = 1
        libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL for its whole duration
        libc.usleep(500_000)
        assert c.answers[t.index] == 1, "not answered while the GIL was held"
        assert (t.slot_of[[3, 5]] >= 0).all() and t.header["ncopy"] == 2
        rows = server.staging[layout.layers[layer].blob_size].array.reshape(
            -1, layout.layers[layer].blob_size
        )
        assert (rows[:2] == store.read(layer, np.array([3, 5]))).all()
        assert t.stats[cb.S_READ] == 2 and t.stats[cb.S_MISSED] == 2
    finally:
        server.close()


def test_poll_interval_backs_off_to_its_cap():
    from moeflux_mlx.cuda import miss_server as ms

    o = Tuning()
    first, cap = o.server_poll_us * 1e-6, o.server_poll_max_us * 1e-6
    steps = [first]
    for _ in range(40):
        steps.append(ms.next_poll_interval(steps[-1], cap))
    assert all(b >= a for a, b in zip(steps, steps[1:]))
    assert steps[-1] == cap and steps[1] <= ms.POLL_GROWTH * steps[0]
    assert ms.next_poll_interval(0.0, cap) == 0.0  # MOEFLUX_SERVER_POLL_US=0 keeps spinning


def test_request_after_a_long_quiet_spell_is_answered_promptly(tiny_store):
    """Every expert resident means table calls in flight and no request: the server's poll
    interval grows to its cap. A miss arriving then must still be answered within ~the cap
    (with the default 1 ms cap; the server process reads MOEFLUX_SERVER_POLL_MAX_US)."""
    from moeflux_mlx.cuda import miss_server as ms

    store, layout = tiny_store
    server = _server(store, layout)
    server_cap_ms = Tuning().server_poll_max_us / 1e3
    try:
        c = server.control
        t = c.layers[c.order[0]]
        server.staging_for(layout.layers[c.order[0]].blob_size, 4)
        # a first request (the server's first read opens files, starts threads), and expert 6
        # in the page cache: what is timed below is the poll, not a disk or a first use
        store.read(c.order[0], np.array([6]))
        t.request[:1] = [5]
        t.header["nreq"] = 1
        c.requests[t.index] = 1
        _wait_answer(c, t.index, 1)
        c.ticks[t.index] += 1
        c.expected[t.index] = c.ticks[t.index] + 1  # a table call in flight, the GPU silent
        # long past the ~20 empty polls that reach the cap, short of STALL_S (then it idles);
        # an interval growing without the cap would be ~0.2 s by now
        time.sleep(0.8 * ms.STALL_S)
        t.request[:1] = [6]
        t.header["nreq"] = 1
        start = time.monotonic()
        c.requests[t.index] = 2
        _wait_answer(c, t.index, 2)
        waited = time.monotonic() - start
        assert waited < 0.05, f"{waited * 1e3:.1f} ms to answer (cap {server_cap_ms} ms)"
        assert t.slot_of[6] >= 0
    finally:
        server.close()


def test_host_requests_admit_and_release(tiny_store):
    store, layout = tiny_store
    server = _server(store, layout, n_slots=3)
    try:
        layer = server.control.order[0]
        t = server.control.layers[layer]
        missing, victims = server.host_request(layer, cb.HOST_ADMIT, np.array([2, 9]))
        assert missing.tolist() == [2, 9] and sorted(t.slot_of[[2, 9]]) == sorted(victims.tolist())
        missing, _ = server.host_request(layer, cb.HOST_ADMIT, np.array([9, 11]))
        assert missing.tolist() == [11]  # 9 was resident
        missing, victims = server.host_request(layer, cb.HOST_ADMIT, np.array([4]))
        assert victims.tolist() == [t.slot_of[4]] and t.slot_of[2] < 0  # LRU: 2 was oldest
        server.host_request(layer, cb.HOST_RELEASE, np.array([4, 11]))
        assert (t.slot_of[[4, 11]] < 0).all() and t.slot_of[9] >= 0
        assert t.header["host_ticks"] == 3  # admits advance the layer's LRU clock
    finally:
        server.close()


def test_server_gone_raises(tiny_store):
    store, layout = tiny_store
    server = _server(store, layout)
    try:
        server.proc.kill()
        server.proc.wait()
        with pytest.raises(DeviceWaitError, match="miss server process exited"):
            server.check()
        with pytest.raises(DeviceWaitError, match="exited"):
            server.host_request(server.control.order[0], cb.HOST_ADMIT, np.array([1]))
    finally:
        server.close()


def test_server_that_cannot_open_the_experts_fails_the_load_clearly(tiny_checkpoints, tmp_path):
    import shutil

    _, packed = tiny_checkpoints["qwen3_moe"]
    copy = shutil.copytree(packed, tmp_path / "m")
    store, layout = open_store(copy, "pread")
    try:
        (copy / "packed_experts" / "layer_01.bin").unlink()  # gone before the server opens it
        with pytest.raises(DeviceWaitError, match="exited.*layer_01.bin"):
            _server(store, layout)
    finally:
        store.close()


def test_server_stops_promptly_and_exits_with_its_parent_socket(tiny_store):
    store, layout = tiny_store
    server = _server(store, layout)
    t = time.perf_counter()
    server.close()
    assert time.perf_counter() - t < 2 and server.proc.poll() is not None
    server = _server(store, layout)
    server._sock.close()  # as if this process died: the server sees its socket close
    assert server.proc.wait(timeout=5) == 0
    server.control.close()


def test_pinned_buffer_is_plain_memory_without_cuda():
    b = PinnedBuffer(10000)
    assert b.array.size == 10000 and b.array.ctypes.data % 4096 == 0 and not b.array.any()
    assert b.fd >= 0  # another process can map it
    b.array[:] = 7
    b.close()


def test_on_by_default_where_cuda_is(monkeypatch):
    """The table runs wherever it can unless ``Tuning`` says otherwise; asked for where it
    cannot run, it does not; no variable switches it."""
    available = cuda_runtime.table_available()
    assert use_table(LoadOptions.resolve().tuning) == available
    assert use_table(Tuning(device_table=True)) == available
    assert not use_table(Tuning(device_table=False))
    monkeypatch.setenv("MOEFLUX_DEVICE_TABLE", "off")  # no longer read
    assert use_table(LoadOptions.resolve().tuning) == available
    monkeypatch.setattr(cuda_runtime, "table_available", lambda: True)
    assert use_table(Tuning()) and not use_table(Tuning(device_table=False))


def test_server_runs_with_descriptors_past_select_s_limit(tiny_store):
    """The server inherits the model process's descriptor numbers; in a process with more than
    1024 files open they pass what select() can watch. It must still serve (it polls)."""
    store, layout = tiny_store
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        server = _server(store, layout)
        try:
            assert server._sock.fileno() > 1024 or server.control.fd > 1024
            layer = server.control.order[0]
            missing, victims = server.host_request(layer, cb.HOST_ADMIT, np.array([1, 2]))
            assert missing.tolist() == [1, 2] and len(victims) == 2
            time.sleep(0.2)  # idle: the server waits for messages (poll) and must not die
            server.check()
        finally:
            server.close()
    finally:
        for fd in held:
            os.close(fd)


def test_decode_through_the_table_lets_the_prefill_s_held_output_go(
    table_on_cpu, reference, monkeypatch
):
    """A whole-layer prefill (no host sync) holds its last layer's output, lazy; the decode that
    follows goes through the table and must let it (and its whole-layer pool) go."""
    packed, prompt, want, total = reference
    model, _ = moeflux_mlx.load(
        packed,
        options=tuned(device_table=True, prefill_whole_layer=1),
        cache_budget=int(0.3 * total),
        backend="ops",
    )  # the ops path is bit-exact with stock
    with model.moeflux as rt:
        assert rt.cache.name == "table"
        assert _greedy(model, prompt) == want
        assert rt.stats.total().unsynced_calls > 0 and rt.cache.whole._pending is None


@contextlib.contextmanager
def _prefilled_through_the_table(packed, prompt, total):
    """The model at 30% through the table (ops: bit-exact with stock) once a whole-layer
    prefill chunk of ``prompt`` has computed and the next pass has started (every layer but the
    last done with); yields ``(model, runtime)``."""
    model, _ = moeflux_mlx.load(
        packed,
        options=tuned(device_table=True, prefill_whole_layer=1),
        cache_budget=int(0.3 * total),
        backend="ops",
    )
    with model.moeflux as rt:
        cache = make_prompt_cache(model)
        model(prompt[None], cache=cache)
        mx.eval([c.state for c in cache])
        rt.cache.whole.begin(0)
        yield model, rt


def test_a_whole_layer_prefill_leaves_the_table_s_slots_empty(table_on_cpu, reference):
    """Through the table, a whole-layer prefill's layers read into pools of their own: the
    slots stay empty (the decode's misses fill them), and decode is exact from there."""
    packed, prompt, want, total = reference
    with _prefilled_through_the_table(packed, prompt, total) as (model, rt):
        assert rt.stats.total().unsynced_calls == len(rt.layout.layers)  # read whole, no sync
        for layer, t in rt.cache.table.control.layers.items():
            assert (t.slot_of < 0).all(), layer
        assert _pool_holds_the_right_experts(rt) == 0
        assert _greedy(model, prompt) == want
        assert _pool_holds_the_right_experts(rt) > 0


def test_a_whole_layer_prefill_teaches_the_miss_server_s_policy(
    table_on_cpu, reference, monkeypatch
):
    """Through the table, a whole-layer prefill's routing (each layer's latest rows, but the
    last layer's) goes to the miss server's policy as calls it did not serve: the layer's clock
    moves on by as many calls and no slot is taken; decode stays exact."""
    packed, prompt, want, total = reference
    with _prefilled_through_the_table(packed, prompt, total) as (model, rt):
        control = rt.cache.table.control
        layers = sorted(control.layers)
        rows = min(prompt.size, OBSERVE_ROWS)
        for layer in layers:
            t = control.layers[layer]
            rt.cache.table.server._answered(layer, int(control.host_requests[t.index]))
            want_ticks = 0 if layer == max(rt.layout.layers) else rows
            assert int(t.header["host_ticks"]) == want_ticks, layer
            assert (t.slot_of < 0).all()
        assert _greedy(model, prompt) == want
