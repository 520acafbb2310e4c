"""The benchmark scripts (benchmarks/*.py) and their library (benchmarks/lib): the research
decode benchmark's runs, cold reads and page-cache tools, its command line, and the prefill and
kernel benchmarks' pieces."""

import argparse
import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwiGLU

from benchmarks.lib import cli, decode, pagecache, report
from benchmarks.lib.routing import RoutingTrace
from moeflux_mlx import measure
from moeflux_mlx.compute import backend as B
from moeflux_mlx.compute import kernels as K
from moeflux_mlx.compute.ops import OpsBackend
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.io import bandwidth


def test_benchmark_runs_and_writes_results(tiny_checkpoints, tmp_path):
    src, packed = tiny_checkpoints["qwen3_moe"]
    result = decode.run_benchmark(
        packed,
        stock_path=src,
        budgets=(1.0, 0.99, 0.25),
        io_modes=("pread",),
        prompt_tokens=16,
        decode_tokens=8,
    )
    names = [(r["name"], r["budget"]) for r in result["runs"]]
    assert names[0] == ("stock mlx-lm", "-")
    assert ("moeflux ops", "100%") in names and ("moeflux ops", "25%") in names
    assert len(names) == 1 + 3  # stock, then 100%, 99% and 25% (one slot lookup off CUDA)
    assert all(result["tokens_identical_to_stock"].values())
    by = {(r["name"], r["budget"]): r for r in result["runs"]}
    # resident: every selection a hit (the fill before the timed decode is not counted)
    assert by[("moeflux ops", "100%")]["hit_rate"] == 1.0
    cold = by[("moeflux ops", "25%")]
    assert cold["mb_read_per_token"] > 0 and cold["io_bound_tps"] > 0 and 0 < cold["hit_rate"] < 1
    # a cold run's bound: the disk's cold rate measured on both sides of it, their mean
    before, after = cold["cold_gb_s_before_after"]
    assert before > 0 and after > 0 and cold["cold_gb_s"] == pytest.approx((before + after) / 2)
    assert cold["io_bound_tps"] == pytest.approx(
        cold["cold_gb_s"] * 1e3 / cold["mb_read_per_token"]
    )
    assert by[("moeflux ops", "100%")]["cold_gb_s"] is None  # warm: the run-wide figure
    assert "prefetch_issued_per_token" not in cold  # prefetch is gone: no column for it
    # checksums: each expert checked once, at its first read; the run's share from its own decode
    total_mb = expert_layout(packed).total_expert_bytes / 1e6
    resident = by[("moeflux ops", "100%")]
    assert resident["checksum_since_load_mb"] == pytest.approx(total_mb)  # all, at the fill
    assert resident["checksum_since_load_s"] > 0 and resident["checksum_mb_per_token"] == 0
    assert resident["checksum_of_io"] is None and resident["checksum_of_decode"] == 0
    assert 0 < cold["checksum_since_load_mb"] <= total_mb + 1e-9
    # the decode's share leaves out what the warm-up and the timed prompt checked
    assert cold["checksum_mb_per_token"] * cold["decode_tokens"] < cold["checksum_since_load_mb"]
    assert cold["checksum_of_io"] == pytest.approx(
        cold["checksum_ms_per_token"] / cold["io_ms_per_token"]
    )
    assert cold["checksum_of_decode"] == pytest.approx(
        cold["checksum_ms_per_token"] * cold["decode_tps"] / 1e3
    )
    assert by[("stock mlx-lm", "-")]["checksum_since_load_mb"] is None
    assert result["sync_overhead_ms_per_layer"] is not None
    files = report.write_results(result, tmp_path, "t")
    assert json.loads(files[0].read_text())["runs"] == result["runs"]
    md = files[1].read_text()
    assert (
        "| config | io | cache |" in md
        and "I/O bound tok/s" in md  # a research column, beyond the product's table
        and "| CRC of io | CRC of decode |" in md
        and "identical to stock mlx-lm: 3/3" in md
    )


def test_page_cache_kept_runs_without_the_dropper_and_says_what_it_held(
    tiny_checkpoints, monkeypatch, tmp_path
):
    """``page_cache="kept"``: cold at the start, then no dropper (RAM decides what the
    page cache keeps); the run says how many of the experts' bytes it held at the end."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("page-cache residency is checked with Linux's mincore")
    _, packed = tiny_checkpoints["qwen3_moe"]
    started = []
    real = decode.PageCacheDropper

    def spy(files, *a, **k):
        started.append(files)
        return real(files, *a, **k)

    monkeypatch.setattr(decode, "PageCacheDropper", spy)
    common = dict(budgets=(0.25,), io_modes=("pread",), prompt_tokens=8, decode_tokens=4)
    kept = decode.run_benchmark(packed, stock=False, page_cache="kept", **common)
    assert not started and kept["page_cache"] == "kept"
    run = kept["runs"][0]
    total = sum(f.stat().st_size for f in bandwidth.expert_files(packed))
    # the decode's misses went through the page cache and stayed there
    assert 0 < run["page_cache_mb"] * 1e6 <= total
    dropped = decode.run_benchmark(packed, stock=False, **common)
    assert started and dropped["page_cache"] == "dropped"
    # the disk's own count: the dropped run's misses all went to the disk
    gone = dropped["runs"][0]
    if gone["disk_mb_per_token"] is not None:  # the dropper runs before the prompt's reads
        assert gone["disk_mb_per_token"] >= 0.5 * gone["mb_read_per_token"]
    md = report.write_results(kept, tmp_path, "t")[1].read_text()
    assert "page cache MB" in md and "disk MB/tok" in md and "start cold" in md
    with pytest.raises(ValueError, match="page_cache"):
        decode.run_benchmark(packed, stock=False, page_cache="warm", **common)


def test_ram_balloon_holds_all_but_what_it_leaves_and_gives_it_back():
    """The balloon takes what is available beyond ``leave`` (a few hundred MiB here, not RAM),
    gives it back when this process takes memory, frees it when it stops; killed (as the OOM
    killer would), it fails loudly."""
    import time

    import numpy as np
    import psutil

    why = pagecache.can_hold_ram()
    if why:
        pytest.skip(why)
    take = 384 << 20
    with pagecache.RamBalloon(psutil.virtual_memory().available - take) as balloon:
        proc = psutil.Process(balloon._proc.pid)
        before = proc.memory_info().rss
        assert before > take // 2  # written, so really taken
        mine = np.ones(take // 2, np.uint8)  # this process takes half of it
        deadline = time.monotonic() + 10
        while proc.memory_info().rss > before - take // 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.memory_info().rss <= before - take // 4  # given back
        del mine
    assert take // 3 < balloon.held_bytes < 3 * take
    assert not psutil.pid_exists(proc.pid) or proc.status() == psutil.STATUS_ZOMBIE
    with pytest.raises(RuntimeError, match="died"):
        with pagecache.RamBalloon(psutil.virtual_memory().available - take) as balloon:
            balloon._proc.kill()
            balloon._proc.wait()


def test_page_cache_share_holds_ram_around_the_cold_decode(tiny_checkpoints, monkeypatch):
    """``page_cache=0.5``: the cold run's prompt and decode run inside a balloon that leaves half
    the experts' bytes (and no dropper); the bench's flag takes a share, and refuses what is
    none or cannot run here."""
    _, packed = tiny_checkpoints["qwen3_moe"]
    events, leaves = [], []

    class Balloon:
        held_bytes = 123 << 20

        def __init__(self, leave):
            leaves.append(leave)

        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    timed = measure.time_generation

    def spy(model, prompt, n, on_first=None):
        if on_first is not None:  # the timed decode (the warm-up has no on_first)
            events.append("decode")
        return timed(model, prompt, n, on_first)

    monkeypatch.setattr(decode, "RamBalloon", Balloon)
    monkeypatch.setattr(decode, "can_hold_ram", lambda: None)
    monkeypatch.setattr(measure, "time_generation", spy)
    monkeypatch.setattr(decode, "PageCacheDropper", lambda *a, **k: pytest.fail("the dropper ran"))
    common = dict(stock=False, io_modes=("pread",), prompt_tokens=8, decode_tokens=4)
    result = decode.run_benchmark(packed, budgets=(1.0, 0.25), page_cache=0.5, **common)
    assert events == ["decode", "enter", "decode", "exit"]  # 100% warm, then 25% inside it
    total = sum(f.stat().st_size for f in bandwidth.expert_files(packed))
    assert leaves == [int(0.5 * decode.expert_layout(packed).total_expert_bytes)]
    assert 0.4 * total < leaves[0] <= 0.5 * total
    cold = result["runs"][1]
    assert cold["ram_held_gb"] == pytest.approx((123 << 20) / 1e9)
    assert "all of RAM but 50% of the experts' bytes" in report.cold_runs(result["page_cache"])
    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    assert parser.parse_args(["--page-cache", "0.25"]).page_cache == 0.25
    assert parser.parse_args(["--page-cache", "KEPT"]).page_cache == "kept"
    for bad in ("2", "0", "warm"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--page-cache", bad])
    monkeypatch.setattr(decode, "can_hold_ram", lambda: "swap is on")
    with pytest.raises(SystemExit):
        parser.parse_args(["--page-cache", "0.25"])
    with pytest.raises(ValueError, match="swap is on"):
        decode.run_benchmark(packed, budgets=(0.25,), page_cache=0.5, **common)


def test_paired_resident_rounds(tiny_checkpoints):
    src, packed = tiny_checkpoints["qwen3_moe"]
    result = decode.run_benchmark(
        packed,
        stock_path=src,
        budgets=(1.0,),
        io_modes=("mmap",),
        prompt_tokens=8,
        decode_tokens=4,
        repeats=2,
    )
    paired = result["paired_resident"]
    assert paired["rounds"] == 2 and len(paired["stock_tps"]) == 2
    assert set(paired["moeflux"]) == {"moeflux ops", report.CEILING}  # on the CPU: ops only
    for r in paired["moeflux"].values():
        assert len(r["tps"]) == 2 and r["median_ratio"] > 0
    lines = report.summary_lines(result)
    assert any("decoding in turn, 2 rounds" in line for line in lines)
    assert any(line.startswith("Ceiling: ") for line in lines)


def test_skipped_experts_read_nothing_and_keep_shapes(tiny_checkpoints):
    """The ceiling's stand-in backend: the shape SwitchGLU returns, no weight touched."""
    import mlx.core as mx

    x = mx.ones((1, 3, 16))
    y = decode.SkippedExperts()(x, mx.zeros((1, 3, 4), mx.uint32), pool=None, activation=None)
    assert y.shape == (1, 3, 4, 16) and mx.array_equal(y[:, :, 2], x)


def _resident_fraction(path) -> float:
    """Share of ``path``'s pages in the page cache (``mincore``)."""
    pages = pagecache.resident_pages(path)
    if pages is None:
        pytest.skip("mincore is unavailable here")
    return float(pages.mean())


def test_page_cache_dropper_drops_while_it_runs(tiny_checkpoints):
    import sys
    import time

    if not sys.platform.startswith("linux"):
        pytest.skip("page-cache residency is checked with Linux's mincore")
    _, packed = tiny_checkpoints["qwen3_moe"]
    files = bandwidth.expert_files(packed)
    for f in files:  # every page cached, as after a warm read
        f.read_bytes()
    assert min(_resident_fraction(f) for f in files) > 0.9
    with bandwidth.PageCacheDropper(files, period_s=1e-3) as dropper:
        proc = dropper._proc
        for f in files:  # read again while it runs: dropped again within milliseconds
            f.read_bytes()
        time.sleep(0.3)
        assert proc.poll() is None  # drops in a process of its own until told to stop
        assert max(_resident_fraction(f) for f in files) < 0.1
    assert dropper.drops >= 3 and proc.poll() == 0  # stopped, and said how often it dropped


def test_cli_builds_the_model_it_is_told(tmp_path):
    """``--set`` and ``--layers`` shape the built random model (the same per-token work with fewer
    experts builds faster), and the run writes its results."""
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    args = parser.parse_args(
        [
            "--size",
            "tiny",
            "--set",
            "num_experts=6",
            "--layers",
            "2",
            "--build-dir",
            str(tmp_path / "m"),
            "--budgets",
            "1",
            "--io",
            "mmap",
            "--prompt-tokens",
            "4",
            "--decode-tokens",
            "2",
            "--no-stock",
            "--out",
            str(tmp_path / "r"),
            "--machine",
            "t",
        ]
    )
    assert cli.run(args) == 0
    built = tmp_path / "m" / "qwen3_moe-tiny-num_experts6-2l"
    config = json.loads((built / "config.json").read_text())
    assert config["num_experts"] == 6 and config["num_hidden_layers"] == 2
    assert list((tmp_path / "r").glob("*-t-decode.json"))
    with __import__("pytest").raises(cli.UsageError, match="KEY=VALUE"):
        cli.parse_config_setting("num_experts")


def test_cli_convert_streams_from_the_packed_copy_and_runs_stock_from_the_original(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    args = parser.parse_args(
        [
            "--size",
            "tiny",
            "--layers",
            "2",
            "--convert",
            "--build-dir",
            str(tmp_path / "m"),
            "--budgets",
            "1",
            "--io",
            "pread",
            "--prompt-tokens",
            "4",
            "--decode-tokens",
            "2",
            "--out",
            str(tmp_path / "r"),
            "--machine",
            "t",
        ]
    )
    assert cli.run(args) == 0
    packed = tmp_path / "m" / "qwen3_moe-tiny-2l-packed"
    assert (packed / "packed_experts").is_dir()
    result = json.loads(next((tmp_path / "r").glob("*-t-decode.json")).read_text())
    assert Path(result["model"]).name == packed.name
    assert result["runs"][0]["name"] == "stock mlx-lm"


def _benchmark_script(name):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefill_benchmark_variants():
    """The prefill benchmark's configurations: the whole-layer switches (pinning) are varied
    only where layers are read whole, the read threads (Tuning) everywhere, and each name says
    what varies."""
    pf = _benchmark_script("prefill")
    p = argparse.Namespace(
        prefill_whole_layer=[4.0, 0.0],
        pin_experts=[True, False],
        threads=[8],
        warm_read_threads=[4, 0],
    )
    runs = list(pf._variants(p))
    # whole: pinned x warm threads; synced: warm threads only
    assert len(runs) == (2 * 2) + 2
    names = {pf._variant_name(p, "pread", 0.25, *r) for r in runs}
    assert len(names) == len(runs)
    assert "moeflux pread 25% whole=4 pinned warm reads on 4" in names
    assert "moeflux pread 25% whole=0 warm reads on all" in names
    whole, switches, threads, warm = runs[0]
    options = pf.tuned(
        prefill_whole_layer=whole, threads=threads, warm_read_threads=warm, **switches
    )
    assert options.pin_experts and options.tuning.prefill_whole_layer == 4.0
    assert (options.tuning.threads, options.tuning.warm_read_threads) == (8, 4)


def test_prefill_rounds_take_distinct_windows_within_the_replayed_trace(tmp_path):
    """With a routing trace every round (the warm-up first) replays its own window, all inside
    the trace, so no round's steps after the prompt find the previous round's experts in the
    slots; a trace shorter than a prompt and its two steps is refused in one line."""
    pf = _benchmark_script("prefill")
    rng = np.random.default_rng(0)
    routed = np.stack([rng.choice(16, (2, 4), replace=True) for _ in range(200)])
    path = tmp_path / "t.npz"
    RoutingTrace(routed, [0, 1], [16, 16], np.full(200, -1)).save(path)
    args = argparse.Namespace(routing_trace=path, prompt_tokens=20, repeats=4)
    shifts = pf._round_shifts(args)
    assert len(shifts) == 5 and shifts[0] == 0 and shifts[-1] + 22 <= 200
    assert all(b - a >= 22 for a, b in zip(shifts, shifts[1:]))  # no overlap here
    args.routing_trace = None
    assert pf._round_shifts(args) == [0] * 5
    args.routing_trace, args.prompt_tokens = path, 199
    with pytest.raises(cli.UsageError, match="200 replayable positions"):
        pf._round_shifts(args)


def test_kernels_benchmark_mxfp4_smoke(tmp_path, monkeypatch):
    """--smoke runs the mxfp4 comparison anywhere (the CPU too: the fused kernels are skipped
    with a note) and writes its row; a shape the fused kernels refuse is reported, with the
    proxy shape their figure would come from, not launched."""
    kb = _benchmark_script("kernels")
    # gpt-oss-120b / 5: 18 16-byte chunks a row in 4-bit, which no down launch shape divides
    monkeypatch.setitem(kb.MODELS, "tiny-gpt-oss", (576, 576, 4))
    kb.main(["--smoke", "--models", "tiny-gpt-oss", "--out", str(tmp_path), "--tag", "t"])
    (result,) = json.loads(next(tmp_path.glob("*-t-kernels.json")).read_text())["results"]
    m = result["mxfp4"]
    assert m["ffn_bytes"] == 4 * 3 * (576 * 576 // 2 + 576 * 576 // 32)  # weights + e8m0 scales
    assert m["gpt_oss_ffn_bytes"] == m["ffn_bytes"] + 4 * 3 * 576 * 2  # + bf16 bias vectors
    assert m["finite"] and all(v > 0 for v in m["gbs"].values())
    assert m["gather_qmm_affine_gbs"] == result["gbs"]["gather_qmm_ffn"] > 0
    assert "no launch shape" in result["fused_refusal"] and m["proxy_shape"]
    md = next(tmp_path.glob("*-t-kernels.md")).read_text()
    assert "## mxfp4 experts (gpt-oss's format)" in md
    rows = [line for line in md.splitlines() if line.startswith("| tiny-gpt-oss (576, 576, 4) |")]
    row = rows[-1]  # the mxfp4 table's, after the main table's
    if mx.default_device() == mx.cpu:
        assert result["fused"].startswith(kb.NO_GPU) and m["max_gain"] is None
        assert row.endswith("| n/a | n/a |") and "fused kernels not timed: no Metal or CUDA" in md
    else:
        assert m["fused_affine_source"].startswith("proxy shape") and m["max_gain"] > 0

    # the real shape: refused for the same reason (the runtime's decision: a GPU runs such a
    # layer on ops, it does not launch it), measured on a GPU at H = I = 3072
    why = kb.fused_refusal(2880, 2880, 4, 64, None)
    assert "down rows of 2880 weights have no launch shape" in why and "90 chunks" in why
    assert kb.covered_proxy(2880, 2880, 4, 64, None) == (3072, 3072)
    gpu = K.KernelBackend("cuda", OpsBackend())
    gpu._available = True
    spec = kb.affine_spec(2880, 2880, 4, 64)
    assert B.layer_choice(gpu, spec, SwiGLU(), topk=4) == B.LayerChoice("ops", why)


def test_prompt_file_gives_the_benchmark_text_to_start_from(tmp_path, monkeypatch):
    """``--prompt-file``: the run starts from the text's first tokens (the tokenizer's ids, not
    random ones); a file too short or unreadable is one usage error."""
    from moeflux_mlx import demo_model

    demo = demo_model.checkpoint_path()
    text = tmp_path / "prompt.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession")
    seen = {}
    real = decode.run_benchmark

    def spy(path, **kw):
        seen["prompt"] = kw["prompt"]
        return real(path, **kw)

    monkeypatch.setattr(cli, "run_benchmark", spy)
    script = _benchmark_script("decode")
    common = ["--budgets", "1", "--io", "mmap", "--decode-tokens", "2"]
    common += ["--no-stock", "--out", str(tmp_path / "r"), "--machine", "t"]
    assert (
        script.main([str(demo), "--prompt-file", str(text), "--prompt-tokens", "6", *common]) == 0
    )
    from mlx_lm.utils import load_tokenizer

    assert seen["prompt"] == load_tokenizer(demo).encode(text.read_text())[:6]
    assert (
        script.main([str(demo), "--prompt-file", str(text), "--prompt-tokens", "999", *common]) == 2
    )
    assert script.main([str(demo), "--prompt-file", str(tmp_path / "none"), *common]) == 2


@pytest.mark.parametrize(
    "lookup, expected", [("both", [False, True]), ("device", [True]), ("host", [False])]
)
def test_lookup_picks_the_slot_lookups_of_partial_budgets(
    tiny_checkpoints, monkeypatch, lookup, expected
):
    """Where the table can run, ``lookup`` chooses which lookups a partial budget decodes with
    (the table is faked available: on the CPU a run asked for it falls back to the host's)."""
    _, packed = tiny_checkpoints["qwen3_moe"]
    seen = []
    real = decode._run_moeflux

    def spy(*a, device_table=None, **kw):
        seen.append((a[4], device_table))  # (budget, lookup asked for)
        return real(*a, device_table=device_table, **kw)

    monkeypatch.setattr(decode, "use_table", lambda tuning: True)
    monkeypatch.setattr(decode, "_run_moeflux", spy)
    decode.run_benchmark(
        packed,
        stock=False,
        budgets=(0.25,),
        io_modes=("pread",),
        prompt_tokens=4,
        decode_tokens=2,
        lookup=lookup,
    )
    assert seen == [(0.25, table) for table in expected]


def _prefill_args(src, out, *more):
    """A tiny prefill run's command line: a 24-token prompt, whole layers read, one round."""
    args = ["--prompt-tokens", "24", "--prefill-whole-layer", "4", "--repeats", "1"]
    return [str(src), *args, "--out", str(out), *more]


def test_prefill_benchmark_says_where_the_time_goes_against_the_bound(
    tiny_checkpoints, tmp_path, capsys
):
    """A tiny prefill on the CPU: the step and passes the prompt took (stock at the same step),
    the first token as stock's, the bytes against a bound measured in the run (a share in
    (0, inf), the rate named), and the wall time split by the layers' counters, per layer and
    in total, printed and in the markdown file."""
    pf = _benchmark_script("prefill")
    src, _ = tiny_checkpoints["qwen3_moe"]
    out = tmp_path / "out"
    assert pf.main(_prefill_args(src, out, "--prefill-step", "8", "--per-layer")) == 0
    printed = capsys.readouterr().out
    result = json.loads(next(out.glob("*.json")).read_text())
    stock, mf = result["rows"]
    assert stock["config"] == "stock mlx-lm" and mf["stock"] == "stock mlx-lm"
    # 23 tokens 8 a pass, then the last position
    assert stock["prefill_step"] == mf["prefill_step"] == 8 and mf["passes"] == stock["passes"] == 4
    assert mf["token_as_stock"] and mf["tokens"] == stock["tokens"]
    assert mf["bytes_moved"] > 0 and 0 < mf["bound_share"] < float("inf")
    assert mf["bound_rate"] == "memcpy" and mf["bound_rate_bytes_s"] > 0
    assert mf["stock_seconds"] == stock["seconds"]
    b = mf["breakdown"]
    assert {"io_s", "upload_s", "sync_s", "compute_s", "bytes_read"} <= set(b["total"])
    assert len(b["layers"]) == 2 and b["total"]["wall_s"] == mf["seconds"]
    counted = sum(b["total"][k] for k in ("io_s", "upload_s", "sync_s", "compute_s"))
    assert b["total"]["rest_s"] == pytest.approx(mf["seconds"] - counted)
    assert sum(lay["bytes_read"] for lay in b["layers"].values()) == b["total"]["bytes_read"]
    md = next(out.glob("*.md")).read_text()
    for text in (printed, md):
        for column in ("read wait s", "copy to device s", "device waits s", "python s", "rest s"):
            assert column in text
        assert "share of bound" in text and "memcpy" in text and "| **total** |" in text
    assert "MISMATCH" not in printed


def test_prefill_benchmark_exits_1_on_a_first_token_unlike_stock(
    tiny_checkpoints, tmp_path, monkeypatch, capsys
):
    """A first token unlike stock's is MISMATCH in the table and on stderr, and exit 1."""
    pf = _benchmark_script("prefill")
    src, _ = tiny_checkpoints["qwen3_moe"]
    real = pf.first_token

    def off_by_one(model, prompt, step):
        t, s, tok, passes = real(model, prompt, step)
        return t, s, tok + hasattr(model, "moeflux"), passes

    monkeypatch.setattr(pf, "first_token", off_by_one)
    assert pf.main(_prefill_args(src, tmp_path, "--prefill-step", "32")) == 1
    captured = capsys.readouterr()
    assert "MISMATCH: moeflux" in captured.err and "| MISMATCH |" in captured.out


def test_prefill_bound_takes_the_slower_rate_and_names_it():
    from benchmarks.lib import copy_rate

    assert copy_rate.bound(2e9, (4e9, "memcpy"), None) == (0.5, 4e9, "memcpy")
    assert copy_rate.bound(2e9, (4e9, "memcpy"), 1e9) == (2.0, 1e9, "disk, cold reads")
    assert copy_rate.bound(2e9, (4e9, "memcpy"), 8e9)[2] == "memcpy"
    rate, what = copy_rate.copy_rate(1 << 20, rounds=1)
    assert rate > 0 and what == "memcpy"  # the CPU backend (tests run there)


def test_transfer_benchmark_times_each_read_of_a_layer(tiny_checkpoints, tmp_path, capsys):
    """On the CPU the transfer benchmark times the reads only (no device copies): each thread
    count's preads and the mapping's copy, every row one layer's bytes at a positive rate, in
    the table printed and the files written."""
    tr = _benchmark_script("transfer")
    _, packed = tiny_checkpoints["qwen3_moe"]
    out = tmp_path / "out"
    argv = [str(packed), "--threads", "1,2", "--rounds", "1", "--out", str(out)]
    assert tr.main(argv) == 0
    result = json.loads(next(out.glob("*-transfer.json")).read_text())
    layer = expert_layout(packed).layers[result["layer"]]
    ways = [r["way"] for r in result["rows"]]
    assert ways == ["pread x1 -> plain", "pread x2 -> plain", "mmap x1 -> plain"]
    for row in result["rows"]:
        assert row["bytes"] == layer.layer_bytes and row["gb_s"] > 0
    assert "pread x2 -> plain" in capsys.readouterr().out
    assert "pread x2" in next(out.glob("*-transfer.md")).read_text()


def test_forecast_benchmark_records_the_curve_and_reuses_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from tests.support import synth

    forecast = _benchmark_script("forecast")
    src = synth.build_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=2)
    argv = ["--model", str(src), "--tokens", "2", "--out", str(tmp_path / "f.md")]
    assert forecast.main(argv) == 0
    assert "recorded the hit-rate curve" in capsys.readouterr().out
    report = (tmp_path / "f.md").read_text()
    assert "Within +-20%:" in report and str(src / "moeflux-hit-curve.json") in report
    assert forecast.main(argv) == 0  # the curve is recorded: no second calibration
    assert "recorded the hit-rate curve" not in capsys.readouterr().out


def test_forecast_benchmark_replays_a_trace_in_the_curve_and_the_decode(tmp_path, monkeypatch):
    """With ``--routing-trace`` both the recorded curve and the measured decode route as the
    trace does: a trace that always routes the same 4 of 16 experts hits every time once a
    quarter of the experts fits, in the curve and in the measurement alike."""
    import numpy as np

    from benchmarks.lib.routing import RoutingTrace
    from tests.support import synth

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    forecast = _benchmark_script("forecast")
    src = synth.build_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=2)
    tokens, layers = 64, 2
    routed = np.tile(np.arange(4, dtype=np.uint8), (tokens, layers, 1))
    trace = RoutingTrace(
        routed=routed,
        layers=list(range(layers)),
        num_experts=[16] * layers,
        tokens=np.full(tokens, -1),
    ).save(tmp_path / "same4.npz")
    out = tmp_path / "f.md"
    argv = ["--model", str(src), "--tokens", "4", "--routing-trace", str(trace), "--out", str(out)]
    assert forecast.main(argv) == 0
    report = out.read_text()
    assert f"routing: replayed from {trace}" in report
    row = next(line for line in report.splitlines() if line.startswith("| 25% | warm |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "100%" and cells[3] == "100%"  # hit rate: forecast, measured


def test_host_path_benchmark_times_each_way_and_a_base_build_in_turn(tiny_checkpoints, capsys):
    """The host-path benchmark times step builds and layer calls of stock, moeflux and moeflux
    with its experts skipped, and a base tree's moeflux rows in the same process (here this
    very checkout's, imported under the base's package name)."""
    hp = _benchmark_script("host_path")
    src, _ = tiny_checkpoints["qwen3_moe"]
    root = Path(__file__).resolve().parents[1]
    assert hp.main(["--model", str(src), "--rounds", "1", "--steps", "2", "--base", str(root)]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    times = {row[0][2:]: float(row[1]) for row in rows if row[0].startswith(("| step", "| layer"))}
    ways = ("stock mlx-lm", "moeflux (ops)", "moeflux, experts skipped")
    ways += ("base moeflux (ops)", "base moeflux, experts skipped")
    assert set(times) == {f"step: {w}" for w in ways} | {
        f"layer call: {w}" for w in ("stock mlx-lm SwitchGLU", *ways[1:])
    }
    assert all(t > 0 for t in times.values())


def test_resident_benchmark_splits_each_model_and_times_the_real_backend(
    tiny_checkpoints, tmp_path
):
    """resident.py decodes stock, moeflux, the ceiling and a partial budget in turn, each step
    split into build, launch and wait; its launch-cost table times the model's own backend even
    when the rounds ended on the ceiling, whose stand-in computes nothing."""
    rs = _benchmark_script("resident")
    src, _ = tiny_checkpoints["qwen3_moe"]
    out = tmp_path / "out"
    argv = [
        str(src),
        "--rounds",
        "2",
        "--decode-tokens",
        "2",
        "--budgets",
        "0.5",
        "--out",
        str(out),
    ]
    assert rs.main(argv) == 0
    result = json.loads(next(out.glob("*-resident.json")).read_text())
    assert set(result["runs"]) == {rs.STOCK, rs.MOEFLUX, rs.CEILING, "moeflux at 50%"}
    for runs in result["runs"].values():
        assert len(runs) == 2 and all(r["build"] > 0 and r["tps"] > 0 for r in runs)
    backend = result["launch_costs"]["expert computation (moeflux's backend)"]
    plain_op = result["launch_costs"]["plain MLX op (x + 1)"]
    # on the CPU plain ops compute the experts: far more device work than one addition
    assert backend["launch"] + backend["wait"] > plain_op["launch"] + plain_op["wait"]
