"""``moeflux-mlx doctor``: the report, the recommended budget and the decode forecast."""

from __future__ import annotations

import os
import re

import mlx.core as mx
import pytest

from moeflux_mlx import cli
from moeflux_mlx.cache import wired
from moeflux_mlx.cache.slots import slots_per_layer
from moeflux_mlx.commands import doctor
from moeflux_mlx.format.checkpoint import expert_layout
from tests.support import synth


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth.build_checkpoint(
        tmp_path_factory.mktemp("doctor") / "m", "qwen3_moe", "tiny", seed=4
    )


def _rows(out):
    return dict(re.findall(r"^(\S.*?|  \S.*?)\s{2,}(.*)$", out, re.M))


def test_forecast_arithmetic(model):
    layout = expert_layout(model)
    k = doctor.top_k_of(model)
    assert k == 4
    routed = sum(k * lay.blob_size for lay in layout.layers.values())
    none = doctor.forecast(layout, k, 0, 1e9, 0.010)
    assert none.hit_rate == 0 and none.miss_bytes_per_token == routed
    assert none.s_per_token == pytest.approx(0.010 + routed / 1e9)
    full = doctor.forecast(layout, k, layout.total_expert_bytes, 1e9, 0.010)
    assert full.hit_rate == 1 and full.io_s_per_token == 0 and full.tok_s == pytest.approx(100)
    half = doctor.forecast(layout, k, layout.total_expert_bytes // 2, 1e9, 0.010)
    assert 0.4 < half.hit_rate < 0.6
    rates = doctor.estimated_hit_rates(layout, layout.total_expert_bytes // 2)
    assert set(rates) == set(layout.layers) and all(0.4 < r <= 0.5 for r in rates.values())


def test_the_forecast_is_the_line_through_two_measured_decodes():
    """``t = t_stream + missed bytes / miss rate`` through two decodes; where the lower budget
    shows no clear rise (noise), the read bandwidth is the miss rate and the line meets the
    first point."""
    t = doctor.fit_timing([(900, 0.030, 100e6), (200, 0.070, 500e6)], 7e9, "warm")
    assert t.bandwidth == pytest.approx(10e9) and t.compute_s_per_token == pytest.approx(0.020)
    assert t.basis == "misses measured in decode"
    for t_lo in (0.029, 0.0300001, 0.0314):  # slower, hardly or within 5%: no line
        flat = doctor.fit_timing([(900, 0.030, 100e6), (200, t_lo, 500e6)], 5e9, "cold")
        assert flat.bandwidth == 5e9 and flat.basis == "cold"
        assert flat.compute_s_per_token == pytest.approx(0.030 - 100e6 / 5e9)
    one = doctor.fit_timing([(900, 0.001, 100e6)], 5e9, "warm")
    assert one.compute_s_per_token == 0.0  # never below nothing


def test_calibration_budgets(model):
    """90% of the experts at most, and 15% of that, raised until every layer holds 1.5x its
    top-k."""
    layout = expert_layout(model)
    total, k = layout.total_expert_bytes, doctor.top_k_of(model)
    hi, lo = doctor.calibration_budgets(layout, k, total)
    assert hi == int(0.9 * total) and lo < hi
    assert min(slots_per_layer(layout, lo).values()) >= 1.5 * k
    assert min(slots_per_layer(layout, lo - 1).values()) < 1.5 * k or lo == int(0.15 * hi)
    assert doctor.calibration_budgets(layout, k, total // 10) == (total // 10, total // 10)


def test_doctor_without_model(capsys):
    assert cli.main(["doctor"]) == 0
    rows = _rows(capsys.readouterr().out)
    for key in ("platform", "mlx", "mlx-lm", "default device", "backend", "RAM"):
        assert key in rows, key
    assert rows["backend"].startswith("ops")
    assert "MODEL" in rows["model"]


def test_doctor_says_what_the_machine_decided(capsys):
    """The choices that are no load options, each with why: off CUDA (this CPU machine, a Mac)
    decode syncs with the host and slots are written from the host."""
    assert cli.main(["doctor"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["decided by the machine"] == "not load options: chosen at load for this machine"
    assert re.fullmatch(r"\d+ \(the cores, 8 to 16\).*", rows["  read threads"])
    assert rows["  whole-layer prefill"].startswith("from ")
    if not mx.cuda.is_available():
        assert rows["  device-side table"].startswith("off: one host sync per call")
        assert rows["  slot writes"] == "host: straight into the slots' memory"
        assert "  miss server" not in rows  # it serves the device-side table only


def test_doctor_backend_metal_reports_metal_or_why_not(capsys):
    """``--backend metal``: the Metal kernels where Metal is; elsewhere (a CPU build, a CUDA
    GPU) the ops fallback and the reason, on every kind of host."""
    assert cli.main(["doctor", "--backend", "metal"]) == 0
    backend = _rows(capsys.readouterr().out)["backend"]
    assert backend.endswith("(requested: metal)")
    if mx.metal.is_available():
        assert backend == "metal (requested: metal)"
    elif mx.default_device() == mx.gpu:
        assert backend.startswith("ops (fallback: metal backend not available on this device)")
    else:
        assert backend.startswith(
            "ops (fallback: metal kernels not available: MLX's default device is the CPU)"
        )


def test_doctor_with_model_measures_and_forecasts(model, capsys):
    assert cli.main(["doctor", str(model)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["recommended cache budget"].endswith("every expert)")
    assert re.match(r"cold [\d.]+ GB/s, warm \(page cache\) [\d.]+ GB/s", rows["read bandwidth"])
    assert re.match(r"cold [\d.]+ GB/s with expert_io=direct", rows["uncached reads"])
    measured = rows["decode, measured"]
    assert len(re.findall(r"[\d.]+ tok/s at \S+ \S+ \(\S+ \S+ missed a token\)", measured)) == 2
    assert re.match(r"[\d.]+ ms/token \+ missed bytes at [\d.]+ GB/s", rows["forecast basis"])
    fc = [k for k in rows if k.strip().startswith("forecast at")]
    assert [k.strip() for k in fc] == [
        "forecast at 0%",
        "forecast at 25%",
        "forecast at 50%",
        "forecast at 100%",
    ]
    assert "hit rate 100%" in rows["  forecast at 100%"]  # from the curve, not n / E


def test_doctor_records_and_shows_the_hit_rate_curve(model, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli.main(["doctor", str(model)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["hit-rate curve"].startswith(str(model / "moeflux-hit-curve.json"))
    at = [k.strip() for k in rows if k.strip().startswith("at ")]
    assert at == [f"at {p}%" for p in range(0, 101, 10)]
    assert re.fullmatch(r"hit rate 0%, forecast [\d.]+ tok/s", rows["  at 0%"])
    assert re.fullmatch(r"hit rate 100%, forecast [\d.]+ tok/s", rows["  at 100%"])
    assert re.match(r"\S+ \S+: auto: every expert", rows["cache budget auto"])
    plot = rows["curve plot"]
    assert plot == "install matplotlib for a plot" or os.path.isfile(plot)


def test_recommended_budget_fits_the_working_set(monkeypatch, model):
    class Mac(wired.MetalMemory):
        def available(self):
            return True

        def working_set(self):
            return 10**9

    monkeypatch.setattr(wired, "MetalMemory", Mac)
    budget, why = doctor.recommended_budget(5 * 10**9, 10**8)
    assert budget == int(0.9 * 10**9) - wired.STAGING_CAP - 10**8 and "working set" in why


def test_disk_bandwidth_without_fadvise(monkeypatch, model):
    monkeypatch.delattr(os, "posix_fadvise")
    cold, warm = doctor.disk_bandwidth(model, reads=8, threads=2)
    assert cold > 0 and warm > 0


def test_doctor_runs_the_model_kernels_self_check(model, monkeypatch, tmp_path, capsys):
    """Where kernels run, doctor checks the model's variants and prints the verdicts (here the
    kernels are CPU fakes computing the ops path, one variant broken)."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwiGLU

    from moeflux_mlx.compute import kernels as K
    from moeflux_mlx.compute import selfcheck as S

    def fake(kind, dialect, variant="plain", broken=None):
        def run(inputs, template, output_shapes, output_dtypes, init_value=None, **kw):
            t = dict(template)
            q = dict(group_size=t["GSZ"], bits=t["BITS"], transpose=True)
            if kind == "glu":
                x = mx.expand_dims(inputs[0], (-2, -3))
                g = mx.gather_qmm(x, *inputs[2:5], rhs_indices=inputs[1], **q)
                u = mx.gather_qmm(x, *inputs[5:8], rhs_indices=inputs[1], **q)
                return [SwiGLU()(u, g).squeeze(-2)]
            h = mx.expand_dims(inputs[0], -2)
            out = mx.gather_qmm(h, *inputs[2:5], rhs_indices=inputs[1], **q).squeeze(-2)
            return [out * (2 if broken else 1)]

        return run

    monkeypatch.setattr(S, "CACHE_DIR", tmp_path / "sc")
    monkeypatch.setattr(K, "_kernel", fake)
    monkeypatch.setattr(K, "dialect_available", lambda d: d == "metal")
    S.forget()
    try:
        assert cli.main(["doctor", str(model), "--no-bench", "--backend", "metal"]) == 0
        rows = _rows(capsys.readouterr().out)
        assert rows["backend"] == "metal (requested: metal)"
        assert rows["self-check (metal)"].startswith("1 of 1 variants passed")
        S.forget()
        K.break_variants("wrong")
        monkeypatch.setattr(S, "CACHE_DIR", tmp_path / "sc2")
        assert cli.main(["doctor", str(model), "--no-bench", "--backend", "metal"]) == 0
        out = capsys.readouterr().out
        rows = _rows(out)
        assert rows["self-check (metal)"].startswith("0 of 1 variants passed")
        assert "mismatch" in rows["  failed"] and "metal glu+down" in rows["  failed"]
    finally:
        K.break_variants(None)
        S.forget()
