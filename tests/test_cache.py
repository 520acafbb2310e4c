"""The expert cache keeps output exact and does what its counters say."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

import moeflux_mlx
from moeflux_mlx.cache.expert_cache import ExpertCache
from moeflux_mlx.errors import ExpertReadError, OptionError
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.options import parse_budget, share_of_experts
from tests.support.tuning import tuned


def _greedy(model, prompt, n=40):
    return [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    src, packed = tiny_checkpoints["deepseek_v3"]
    model, tokenizer = mlx_lm.load(str(src))
    prompt = mx.array(tokenizer.encode("the quick brown fox jumps over the lazy dog"))
    total = expert_layout(packed).total_expert_bytes
    return packed, prompt, _greedy(model, prompt), total


def test_parse_budget():
    ram = moeflux_mlx.options.psutil.virtual_memory().total
    assert parse_budget("all", 123) == 123
    assert parse_budget("2GiB", 1) == 2 * 2**30 and parse_budget("2GB", 1) == 2 * 10**9
    assert parse_budget("512MiB", 1) == 512 * 2**20
    assert parse_budget("25% RAM", 10) == int(0.25 * ram)
    assert parse_budget("50% experts", 10) == parse_budget(share_of_experts(0.5), 10) == 5
    assert parse_budget(1000, 10) == parse_budget("1000B", 10) == 1000
    assert parse_budget(None, 10) == 10
    with pytest.raises(ValueError, match="cache budget"):
        parse_budget("lots", 10)
    with pytest.raises(ValueError, match="negative"):
        parse_budget(-1, 10)
    with pytest.raises(OptionError, match="names no base"):  # a share of what?
        parse_budget(0.25, 10)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_lru_cache_hits_and_bounded_slots(reference, fraction):
    packed, prompt, want, total = reference
    model, _ = moeflux_mlx.load(packed, cache_budget=int(fraction * total))
    with model.moeflux as rt:
        # on the CPU every partly cached layer takes one host sync into slots kept by transition
        assert isinstance(rt.cache, ExpertCache) and rt.cache.table is None
        assert rt.cache.name == "transition"
        assert rt.cache.capacity_bytes <= fraction * total
        assert _greedy(model, prompt) == want
        t = rt.stats.total()
        assert 0 < t.experts_missed < t.experts_routed
        assert t.bytes_read == t.experts_read * next(iter(rt.layout.layers.values())).blob_size
        slots = rt.cache.slots
        assert slots.pools and not slots.resident
        for layer, pool in slots.pools.items():
            assert pool.n_slots == slots.n_slots[layer] < rt.layout.layers[layer].num_experts


def test_zero_budget_stages_every_call(reference):
    packed, prompt, want, _ = reference
    model, _ = moeflux_mlx.load(packed, cache_budget=0)
    with model.moeflux as rt:
        assert rt.cache.name == "staging" and rt.cache.capacity_bytes == 0
        assert _greedy(model, prompt) == want
        assert not rt.cache.slots.pools and not rt.cache.slots.resident
        t = rt.stats.total()
        assert t.experts_missed == t.experts_routed == t.experts_read


@pytest.mark.parametrize("budget", [0, 0.25])
def test_a_lasting_read_fault_reaches_the_caller_and_the_model_reads_again(
    reference, monkeypatch, budget
):
    packed, prompt, want, total = reference
    model, _ = moeflux_mlx.load(packed, cache_budget=int(budget * total), expert_io="pread")
    import moeflux_mlx.format.readers as readers

    with model.moeflux:
        assert _greedy(model, prompt, 8) == want[:8]

        def eio(fd, start, into, what):
            raise ExpertReadError(f"{what}: injected lasting fault")

        monkeypatch.setattr(readers, "read_exact", eio)  # every read fails: the caller hears it
        with pytest.raises(ExpertReadError, match="injected lasting fault"):
            _greedy(model, prompt, 8)
        monkeypatch.undo()  # the slots a failed read was meant for claim no expert: exact again
        assert _greedy(model, prompt) == want


@pytest.mark.parametrize("budget", [0, 0.25, "all"])
def test_device_slot_writes_are_exact(reference, monkeypatch, budget):
    """The CUDA write path (host staging + scatter into the pool), exercised on this backend."""
    packed, prompt, want, total = reference
    model, _ = moeflux_mlx.load(
        packed,
        options=tuned(slot_writes="device"),
        cache_budget=budget if budget == "all" else int(budget * total),
    )
    with model.moeflux as rt:
        assert _greedy(model, prompt) == want
        slots = rt.cache.slots
        pools = {**slots.pools, **{("staging", k): p for k, p in slots._staging_pools.items()}}
        assert pools and all(p.device_writes and p.host is None for p in pools.values())
        if budget == 0.25:
            assert 0 < rt.stats.hit_rate < 1


@pytest.mark.parametrize("writes", ["host", "device"])
def test_buffers_do_not_grow_per_layer_after_a_prefill(reference, monkeypatch, writes):
    """A prefill routes most experts of every layer; what stays allocated afterwards must not be
    per layer (with experts many times RAM that would be every expert again)."""
    import moeflux_mlx.cache.pool as pool
    import moeflux_mlx.cache.slots as slots
    import moeflux_mlx.cache.whole_layer as whole_layer
    import moeflux_mlx.io.store as store

    packed, prompt, want, _ = reference
    blob = next(iter(expert_layout(packed).layers.values())).blob_size
    keep = 6 * blob  # more than one decode token's experts, fewer than a prefill's
    for module in (pool, slots, whole_layer, store):
        monkeypatch.setattr(module, "STAGING_KEEP_BYTES", keep)
    long_prompt = mx.concatenate([prompt] * 6)
    model, _ = moeflux_mlx.load(
        packed, options=tuned(slot_writes=writes), cache_budget=0, expert_io="pread"
    )
    with model.moeflux as rt:
        ref_model, _ = mlx_lm.load(str(reference_src(packed)))
        assert _greedy(model, long_prompt, 12) == _greedy(ref_model, long_prompt, 12)
        staging_pools = rt.cache.slots._staging_pools
        assert len(staging_pools) == 1  # every layer shares one pool (one layout)
        assert all(p.nbytes <= keep for p in staging_pools.values())
        assert not rt.cache.slots.pools  # no slots at budget 0
        staged = rt.store._staging
        assert staged is None or staged.nbytes <= keep
        reads = rt.cache.whole.reads  # a prefill's whole layers: kept buffers within keep too
        assert reads._host_buf is None or reads._host_buf.nbytes <= keep
        if reads.staging is not None:  # page-locked: two layers' worth, whatever the layers
            layer_bytes = max(lay.layer_bytes for lay in rt.layout.layers.values())
            assert reads.staging.nbytes <= reads.staging.BUFFERS * layer_bytes
        if writes == "device":
            buf = rt.cache.staging._buf
            assert buf is None or buf.size <= keep


def reference_src(packed):
    return packed.with_name(packed.name.replace("-packed", ""))


@pytest.mark.parametrize("budget", [0, "all"])
def test_every_call_counts_its_tokens(reference, budget):
    """Each layer counts the tokens of every call, resident or read, not only synced ones."""
    packed, prompt, _, total = reference
    model, _ = moeflux_mlx.load(packed, cache_budget=budget)
    with model.moeflux as rt:
        n = 6
        _greedy(model, prompt, n)
        layers = moeflux_mlx.stats(model)["layers"]
        # the prompt, then one token per call: n of them (mlx-lm computes one token ahead)
        assert {s["tokens"] for s in layers.values()} == {prompt.size + n}
        assert rt.stats.total().tokens == len(layers) * (prompt.size + n)
