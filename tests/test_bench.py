"""``moeflux-mlx bench`` and its runner (``moeflux_mlx.measure``): a user's model against stock
mlx-lm at a few cache budgets, end to end; and the disk's rate that doctor measures
(``moeflux_mlx.io.bandwidth``)."""

import json
import os

import pytest

from moeflux_mlx import measure
from moeflux_mlx.commands import bench as bench_cmd
from moeflux_mlx.io import bandwidth


def test_bench_runs_against_stock_and_writes_results(tiny_checkpoints, tmp_path):
    """Stock first, then one run per budget, each announced as it starts; the ratios are to
    stock's decode rate, the partial budget reads experts, and the files hold the rows."""
    src, _ = tiny_checkpoints["qwen3_moe"]
    lines = []
    result = measure.run_bench(
        src, budgets=(1.0, 0.25), prompt_tokens=8, decode_tokens=4, progress=lines.append
    )
    assert lines == [
        "[1/3] stock mlx-lm ...",
        "[2/3] moeflux, 100% of the experts cached ...",
        "[3/3] moeflux, 25% of the experts cached ...",
    ]
    runs = result["runs"]
    assert [(r["name"], r["budget"]) for r in runs] == [
        ("stock mlx-lm", "-"),
        ("moeflux ops", "100%"),
        ("moeflux ops", "25%"),
    ]
    assert runs[0]["ratio_to_stock"] == 1.0
    for r in runs[1:]:
        assert r["ratio_to_stock"] == pytest.approx(r["decode_tps"] / runs[0]["decode_tps"])
    assert runs[1]["hit_rate"] == 1.0  # resident: every expert routed is a hit
    assert runs[2]["mb_read_per_token"] > 0 and 0 < runs[2]["hit_rate"] < 1
    # a plain checkpoint records no checksums: nothing checked, nothing counted
    assert [r["checksum_mb_per_token"] for r in runs] == [0, 0, 0]
    assert all(result["tokens_identical_to_stock"].values())
    assert set(result["tokens_identical_to_stock"]) == {
        f"{r['name']} {r['io_mode']} {r['budget']}" for r in runs[1:]
    }
    files = measure.write_results(result, tmp_path, "t")
    assert json.loads(files[0].read_text())["runs"] == runs
    md = files[1].read_text()
    assert "| config | io | cache |" in md and "x stock" in md
    assert "Greedy tokens identical to stock mlx-lm: 2/2 runs." in md
    assert (len(files) == 3) == (measure.plot_unavailable() is None)
    # a second result of that name does not overwrite the first
    assert measure.write_results(result, tmp_path, "t")[0].name == "t-2.json"


def test_bench_command_on_the_demo_model(tmp_path, capsys):
    """No MODEL: the built-in demo model; the table on stdout, the files in --out. The research
    switches are not the user's command's."""
    out = tmp_path / "r"
    argv = ["--budgets", "1", "--prompt-tokens", "4", "--decode-tokens", "2", "--no-stock"]
    argv += ["--expert-io", "pread", "--out", str(out), "--machine", "t"]
    assert bench_cmd.main(argv) == 0
    printed = capsys.readouterr()
    assert "| moeflux " in printed.out and "| pread | 100% |" in printed.out
    assert "[1/1] moeflux, 100% of the experts cached ..." in printed.err
    (json_file,) = out.glob("*-t-decode.json")
    result = json.loads(json_file.read_text())
    assert [r["budget"] for r in result["runs"]] == ["100%"]
    for research in (["--prefetch", "on"], ["--io", "mmap"], ["--arch", "qwen3_moe"]):
        with pytest.raises(SystemExit) as refused:
            bench_cmd.main([*argv, *research])
        assert refused.value.code == 2


def test_budgets_are_shares_of_the_experts():
    assert bench_cmd.budget_list("1,0.5,0") == [1.0, 0.5, 0.0]
    for bad in ("2", "-0.1", "half"):
        with pytest.raises(Exception, match="fraction|number"):
            bench_cmd.budget_list(bad)


def _file_of(fd):
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _bytes_of(reads):
    """``{file: sorted [start, end) ranges}`` of ``(file, start, n)`` reads, touching ranges merged,
    and whether any byte was read twice."""
    spans, twice = {}, False
    for f, start, n in sorted(reads):
        mine = spans.setdefault(f, [])
        if mine and start < mine[-1][1]:
            twice = True
        if mine and start <= mine[-1][1]:
            mine[-1][1] = max(mine[-1][1], start + n)
        else:
            mine.append([start, start + n])
    return spans, twice


@pytest.mark.parametrize("which", ["plain", "converted"])
@pytest.mark.parametrize("reads", [5, 10**6])
def test_cold_bandwidth_reads_distinct_whole_experts(tiny_checkpoints, monkeypatch, which, reads):
    """The I/O bound's rate: each pass reads every byte of ``reads`` distinct experts (all of
    them when there are fewer) where the layout puts them, once, and nothing else (reads at
    random offsets overlapped, and bytes the page cache served counted as the disk's), through
    the store, one call per layer."""
    from moeflux_mlx.format import readers
    from moeflux_mlx.io.store import ExpertStore, open_store

    src, packed = tiny_checkpoints["qwen3_moe"]
    path = src if which == "plain" else packed
    done, calls = [], []
    real = readers.read_exact
    monkeypatch.setattr(
        readers,
        "read_exact",
        lambda fd, at, into, what: (
            done.append((_file_of(fd), at, len(into))),
            real(fd, at, into, what),
        )[1],
    )
    real_read = ExpertStore.read
    monkeypatch.setattr(
        ExpertStore,
        "read",
        lambda self, layer, ex, out=None: (
            calls.append((layer, len(ex), len(done))),
            real_read(self, layer, ex, out),
        )[1],
    )
    dropped = []
    monkeypatch.setattr(bandwidth, "drop_page_cache", lambda files: dropped.append(len(done)))
    cold, warm = bandwidth.read_bandwidth(path, reads=reads, threads=3)
    assert cold > 0 and warm > 0 and dropped == [0]  # dropped once, before the cold pass
    store, layout = open_store(path, "pread", threads=1)
    with store:
        expert_bytes = {
            (i, e): {(_file_of(fd), start, n) for fd, start, _, n, _ in store.layers[i].pieces(e)}
            for i, lay in layout.layers.items()
            for e in range(lay.num_experts)
        }
    n = min(reads, len(expert_bytes))
    # the cold pass, an untimed one that caches what it read, then the warm pass
    per_pass = len(calls) // 3
    assert len(calls) == 3 * per_pass and len({layer for layer, _, _ in calls}) == per_pass
    starts = [calls[k * per_pass][2] for k in range(3)] + [len(done)]
    passes = [done[starts[k] : starts[k + 1]] for k in range(3)]
    assert _bytes_of(passes[0]) == _bytes_of(passes[1]) == _bytes_of(passes[2])
    spans, twice = _bytes_of(passes[0])
    assert not twice
    # exactly the bytes of n whole experts
    covered = [
        key
        for key, pieces in expert_bytes.items()
        if all(
            any(a <= start and start + size <= b for a, b in spans.get(f, []))
            for f, start, size in pieces
        )
    ]
    assert len(covered) == n
    read = sum(b - a for mine in spans.values() for a, b in mine)
    assert read == sum(size for key in covered for _, _, size in expert_bytes[key])
