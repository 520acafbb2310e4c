"""Memory macOS will not page out (moeflux_mlx.cache.wired), tested with a stand-in for MLX's
Metal memory controls: the budget fits the recommended working set, and the slots are wired
while the model is open, the old limit put back at close."""

from __future__ import annotations

import logging

import pytest

import moeflux_mlx
from moeflux_mlx.cache import wired
from moeflux_mlx.format.checkpoint import expert_layout
from tests.support import synth

GB = 10**9


class FakeMetal(wired.MetalMemory):
    """A Mac with ``ws`` bytes of recommended working set; records every wired limit set."""

    def __init__(self, ws=None, limit=0, fail=False):
        self.ws, self.limit, self.fail, self.calls = ws, limit, fail, []

    def available(self):
        return self.ws is not None

    def working_set(self):
        return self.ws

    def set_wired_limit(self, limit):
        if self.fail:
            raise RuntimeError("[metal::set_wired_limit] needs macOS 15")
        old, self.limit = self.limit, limit
        self.calls.append(limit)
        return old


def test_fit_budget():
    # no working set (CPU, CUDA): unchanged
    assert wired.fit_budget(50 * GB, GB, None) == (50 * GB, None)
    # fits: unchanged
    assert wired.fit_budget(10 * GB, GB, 48 * GB, 5 * GB) == (10 * GB, None)
    # too big: cut to 90% of the working set less staging and dense weights, with a note
    budget, note = wired.fit_budget(60 * GB, GB, 48 * GB, 5 * GB)
    assert budget == int(48 * GB * 0.9) - GB - 5 * GB
    assert "working set" in note and "page" in note
    # nothing left: zero (experts streamed through staging only)
    assert wired.fit_budget(10 * GB, GB, 4 * GB, 8 * GB)[0] == 0
    assert wired.fit_budget(0, GB, 48 * GB) == (0, None)


def test_wiring_raises_and_restores_the_limit():
    mem = FakeMetal(ws=48 * GB, limit=2 * GB)
    w = wired.Wiring(20 * GB, mem)
    assert w.wired and mem.limit == 20 * GB and w.previous == 2 * GB
    w.close()
    assert mem.limit == 2 * GB and not w.previous
    w.close()  # twice: nothing more
    assert mem.calls == [0, 20 * GB, 2 * GB]


def test_wiring_never_lowers_nor_exceeds(caplog):
    mem = FakeMetal(ws=48 * GB, limit=40 * GB)  # mlx-lm's generate already raised it
    w = wired.Wiring(20 * GB, mem)
    assert mem.limit == 40 * GB
    w.close()
    caplog.set_level(logging.WARNING, logger="moeflux_mlx")
    mem = FakeMetal(ws=48 * GB)
    w = wired.Wiring(60 * GB, mem)
    assert mem.limit == 48 * GB and "exceed the recommended working set" in caplog.text
    w.close()
    assert mem.limit == 0


def test_no_wiring_where_it_cannot():
    for mem in (FakeMetal(ws=None), FakeMetal(ws=48 * GB, fail=True)):
        w = wired.Wiring(GB, mem)
        assert not w.wired
        w.close()
    mem = FakeMetal(ws=48 * GB)
    assert not wired.Wiring(0, mem).wired and mem.calls == []


def test_staging_estimate(tmp_path):
    src = synth.build_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=2)
    layout = expert_layout(src)
    largest = max(lay.layer_bytes for lay in layout.layers.values())
    assert wired.staging_bytes_estimate(layout) == min(largest, wired.STAGING_CAP)
    assert wired.staging_bytes_estimate(None) == wired.STAGING_CAP


@pytest.fixture
def fake_mac(monkeypatch):
    """A 'Mac' whose working set holds the dense weights but only part of the experts."""
    mems = []

    def make():
        mem = FakeMetal(ws=FakeMetal.ws_for_test, limit=1)
        mems.append(mem)
        return mem

    monkeypatch.setattr(wired, "MetalMemory", make)
    return mems


def test_model_budget_fitted_and_slots_wired(tmp_path, fake_mac, caplog):
    src = synth.build_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=2)
    layout = expert_layout(src)
    total = layout.total_expert_bytes
    staging = wired.staging_bytes_estimate(layout)
    # a working set whose 90% holds the staging and half the experts
    FakeMetal.ws_for_test = int((staging + total // 2) / 0.9) + 1
    caplog.set_level(logging.WARNING, logger="moeflux_mlx")
    model, _ = moeflux_mlx.load(src, cache_budget="all", backend="ops")
    rt = model.moeflux
    assert "cut from" in caplog.text
    capacity = rt.cache.capacity_bytes
    assert 0 < capacity <= total // 2 + 1
    wiring = rt.wiring
    assert wiring.wired and wiring.memory.limit == capacity + staging
    rt.close()
    assert wiring.memory.limit == 1  # the limit found at load, put back
    # the CPU (no working set): nothing cut, nothing wired
    FakeMetal.ws_for_test = None
    model, _ = moeflux_mlx.load(src, cache_budget="all", backend="ops")
    assert model.moeflux.cache.capacity_bytes == total and not model.moeflux.wiring.wired
    model.moeflux.close()
