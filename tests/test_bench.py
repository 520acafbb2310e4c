"""The decode benchmark runs end to end and reports what it measured."""

import json

from moeflux_mlx import bench


def test_benchmark_runs_and_writes_results(tiny_checkpoints, tmp_path):
    src, packed = tiny_checkpoints["qwen3_moe"]
    result = bench.run_benchmark(packed, stock_path=src, budgets=(1.0, 0.99, 0.25),
                                 io_modes=("pread",), prefetch=(False, True), prompt_tokens=16,
                                 decode_tokens=8)
    names = [(r["name"], r["budget"]) for r in result["runs"]]
    assert names[0] == ("stock mlx-lm", "-")
    assert ("moeflux ops", "100%") in names and ("moeflux ops +prefetch", "25%") in names
    assert len(names) == 1 + 1 + 2 + 2  # stock, 100%, then 99% and 25% with and without prefetch
    assert all(result["tokens_identical_to_stock"].values())
    by = {(r["name"], r["budget"]): r for r in result["runs"]}
    assert by[("moeflux ops", "100%")]["hit_rate"] is None  # resident: no syncs to count
    cold = by[("moeflux ops", "25%")]
    assert cold["mb_read_per_token"] > 0 and cold["io_bound_tps"] > 0 and 0 < cold["hit_rate"] < 1
    assert result["sync_overhead_ms_per_layer"] is not None
    files = bench.write_results(result, tmp_path, "t")
    assert json.loads(files[0].read_text())["runs"] == result["runs"]
    md = files[1].read_text()
    assert "| config | io | cache |" in md and "identical to stock mlx-lm: 5/5" in md
