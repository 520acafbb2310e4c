"""benchmarks/probes/commit_ab.py: settings parse strictly, and each run's rows are the ones compared."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "commit_ab.py"
_spec = importlib.util.spec_from_file_location("commit_ab", _PATH)
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def test_settings_parse():
    assert ab.parse_setting("default:") == ("default", {})
    assert ab.parse_setting("big:MLX_MAX_OPS_PER_BUFFER=4096, MLX_MAX_MB_PER_BUFFER=9") == (
        "big",
        {"MLX_MAX_OPS_PER_BUFFER": "4096", "MLX_MAX_MB_PER_BUFFER": "9"},
    )
    with pytest.raises(ValueError, match="expected name:MLX_VAR=VALUE"):
        ab.parse_setting("x:PATH=/tmp")  # only MLX's own variables
    with pytest.raises(ValueError):
        ab.parse_setting("x:MLX_USE_CUDA_GRAPHS")


def test_summary_takes_the_compared_rows():
    def row(name, budget, lookup, tps, **kw):
        base = dict(
            name=name,
            budget=budget,
            lookup=lookup,
            decode_tps=tps,
            gpu_wait_ms_per_token=0.0,
            io_ms_per_token=0.0,
            other_ms_per_token=0.0,
            fraction_of_io_bound=None,
            mb_read_per_token=0.0,
        )
        return {**base, **kw}

    result = {
        "cold_read_gb_s": 1.5,
        "runs": [
            row("stock mlx-lm", "-", "-", 300.0),
            row("moeflux cuda", "100%", "-", 330.0),
            row("moeflux cuda", "100%", "device", 250.0),
            row("moeflux cuda", "25%", "host", 40.0, fraction_of_io_bound=0.4),
            row(
                "moeflux cuda",
                "25%",
                "device",
                70.0,
                gpu_wait_ms_per_token=11.0,
                other_ms_per_token=3.3,
                fraction_of_io_bound=0.6,
            ),
        ],
    }
    s = ab.summarize(result, "25%")
    assert (s["stock_tps"], s["resident_tps"]) == (300.0, 330.0)  # not the table's 100% row
    assert s["device"]["decode_tps"] == 70.0 and s["device"]["gpu_wait_ms_per_token"] == 11.0
    assert s["host"]["fraction_of_io_bound"] == 0.4
    line = ab.format_rows([{"round": 1, "setting": "default", "summary": s}]).splitlines()[-1]
    assert line == "| 1 | default | 300.0 | 330.0 | 70.0 | 11.00 | 3.30 | 60% | 40.0 | 40% |"
    assert "device" not in ab.summarize(result, "10%")  # no row at that budget: no figures
