"""The real models at their real size, without their weights: sparse checkpoints
(``testing/realscale.py``) whose headers, names, shapes, dtypes and file sizes are those of
Qwen3-30B-A3B, Qwen3.5-397B-A17B, DeepSeek-V3 (Cogito-V2 671B), Kimi-K2 (1T; 4-bit, and 8-bit
for over a terabyte of experts), gpt-oss-120b (MXFP4-Q8) and Llama-4-Maverick; the weights
are holes. No expert is computed; what is checked is every layout, offset and size that tiny
models cannot show: ``info``'s facts, the store's reads (offsets and lengths, against markers
written where the headers say each expert lies), ``convert``'s plan and layer files, and that
loading costs no memory for the experts, even at 1 TB."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import psutil
import pytest

from moeflux_mlx.commands.info import describe
from moeflux_mlx.format import convert as convert_module
from moeflux_mlx.format.checkpoint import check_packed, packed_file, packed_layout, scan_checkpoint
from moeflux_mlx.format.convert import convert
from moeflux_mlx.io.store import open_store, select_expert_io
from moeflux_mlx.options import parse_budget
from tests.support import realscale

MODELS = sorted(realscale.REAL_MODELS)
GiB = 1024**3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("realscale")
    out = {name: realscale.write_sparse_checkpoint(root / name, name) for name in MODELS}
    yield out
    for path in out.values():  # nothing real was written, but say so
        assert realscale.disk_bytes(path) < 16 << 20


def _headers(path):
    """Each tensor's (file, absolute start, nbytes, dtype, shape), parsed here from scratch."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                a, b = t["data_offsets"]
                out[name] = (f, 8 + n + a, b - a, t["dtype"], tuple(t["shape"]))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_the_real_shapes_and_sizes(checkpoints, name):
    """The files are as big as the published ones; the experts the scan finds are the model's,
    with blobs of the size the config alone gives."""
    path, spec = checkpoints[name], realscale.REAL_MODELS[name]
    size = realscale.apparent_bytes(path)
    if spec.approx_bytes:
        assert abs(size / spec.approx_bytes - 1) < 0.05, (name, size)
    layout = scan_checkpoint(path).layout
    layers, blob = realscale.expected_expert_bytes(name)
    experts = realscale.expert_count(name)
    assert len(layout.layers) == layers
    assert {lay.blob_size for lay in layout.layers.values()} == {blob}
    assert {lay.num_experts for lay in layout.layers.values()} == {experts}
    assert layout.total_expert_bytes == layers * experts * blob
    assert size - layout.total_expert_bytes > 0  # dense weights remain


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("ram_gib", [64, 512])
def test_info_ram_gate_and_default_budget(checkpoints, monkeypatch, name, ram_gib):
    """``info`` on a 64 GiB and a 512 GiB machine: expert bytes, the RAM gate's choice (direct
    above 8 x RAM on Linux, pread above 0.75 x RAM), the default budget (all experts if they fit
    in 0.4 x RAM, else 0.4 x RAM)."""

    class VM:
        total = ram_gib * GiB
        available = total // 2

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM)
    monkeypatch.delenv("MOEFLUX_EXPERT_IO", raising=False)
    path = checkpoints[name]
    total = scan_checkpoint(path).layout.total_expert_bytes
    rows = dict(describe(path))
    assert f"({total:,} bytes)" in rows["experts, total"]
    if total > 8 * VM.total and sys.platform.startswith("linux"):
        gate = "direct"
    else:
        gate = "pread" if total > 0.75 * VM.total else "mmap"
    assert select_expert_io(total) == gate
    assert rows["expert I/O"].startswith(f"{gate} (auto: ")
    budget = parse_budget(None, total)
    assert budget == int(min(total, 0.4 * VM.total))
    assert f"({100 * budget / total:.0f}% of them; default)" in rows["expert cache"]


def _markers(path, layout, layers, experts):
    """Write 8 marker bytes at the first and the last bytes of each chosen expert's slice of
    every stacked tensor, where the headers (parsed independently) say it lies."""
    headers = _headers(path)
    written = {}
    for layer in layers:
        module = layout.module_paths[layer]
        for ci, c in enumerate(layout.layers[layer].components):
            f, start, nbytes, dtype, shape = headers[f"{module}.{c.name}"]
            per_expert = nbytes // shape[0]
            assert per_expert == c.nbytes and dtype == c.dtype and shape[1:] == c.shape
            fd = os.open(f, os.O_WRONLY)
            try:
                for e in experts:
                    head = struct.pack("<HHHH", layer, e, ci, 0xA5A5)
                    tail = struct.pack("<HHHH", layer, e, ci, 0x5A5A)
                    at = start + e * per_expert
                    os.pwrite(fd, head, at)
                    os.pwrite(fd, tail, at + per_expert - 8)
                    written[(layer, e, c.name)] = (head, tail)
            finally:
                os.close(fd)
    return written


def _check_blob(blob, lay, layer, e, written):
    for c in lay.components:
        head, tail = written[(layer, e, c.name)]
        part = blob[c.offset : c.offset + c.nbytes].tobytes()
        assert part[:8] == head and part[-8:] == tail, (layer, e, c.name)
        assert not np.any(blob[c.offset + 8 : c.offset + c.nbytes - 8][::4099]), (layer, e, c.name)


@pytest.mark.parametrize("name", MODELS)
def test_store_reads_offsets_and_lengths(checkpoints, name):
    """Experts 0, 1, the middle and the last of the first and last MoE layers, read by pread
    (whole and in pieces) and out of an mmap: each component's bytes start and end where the
    header says, in the blob where the layout puts them."""
    path = checkpoints[name]
    layout = scan_checkpoint(path).layout
    first, last = min(layout.layers), max(layout.layers)
    n = layout.layers[first].num_experts
    experts = [0, 1, n // 2, n - 1]
    written = _markers(path, layout, (first, last), experts)
    for io in ("pread", "mmap"):
        store, _ = open_store(path, io, threads=4)
        with store:
            for layer in (first, last):
                lay = layout.layers[layer]
                src = store.layers[layer]
                for e in experts:
                    pieces = src.pieces(e)
                    assert [p[2:4] for p in pieces] == [
                        (c.offset, c.nbytes) for c in lay.components
                    ]
                blobs = store.read(layer, np.array(experts))
                assert blobs.shape == (len(experts), lay.blob_size)
                for i, e in enumerate(experts):
                    _check_blob(blobs[i], lay, layer, e, written)


@pytest.mark.parametrize(
    "sizes",
    [[1769472] * 5, [7077888, 1769472, 3 * 4096], [4096] * 3, [300_000], [7077888] * 4],
)
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_a_call_s_reads_are_dealt_in_equal_shares(tmp_path, sizes, threads):
    """Every byte of a call's reads is read once, into its place; the shares are at most one per
    thread, all but the last the same page multiple and none but a lone one under the minimum,
    and no piece is longer than ``READ_PIECE_BYTES``, or for a large share an eighth of it."""
    from moeflux_mlx.io import store as st

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, sum(sizes) + 3 * 4096 * len(sizes), dtype=np.uint8)
    path = tmp_path / "blobs.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        starts = [4096 * 3 * i + sum(sizes[:i]) for i in range(len(sizes))][::-1]  # any order
        outs = [np.zeros(n, np.uint8) for n in sizes[::-1]]
        shares = st.balanced_shares(
            [(fd, a, out, f"expert {i}") for i, (a, out) in enumerate(zip(starts, outs))], threads
        )
        for share in shares:
            st._run_jobs(share)
    finally:
        os.close(fd)
    for a, out in zip(starts, outs):
        assert np.array_equal(out, data[a : a + len(out)])
    per_share = [sum(len(job[3]) for job in share) for share in shares]
    assert len(shares) <= threads and sum(per_share) == sum(sizes)
    if len(shares) > 1:
        assert len(set(per_share[:-1])) == 1 and per_share[0] % st.PAGE_BYTES == 0
        assert per_share[-1] <= per_share[0] and per_share[0] >= st.MIN_SHARE_BYTES
    assert len(shares) == min(threads, max(1, sum(sizes) // st.MIN_SHARE_BYTES))
    longest = max(len(job[3]) for share in shares for job in share)
    assert longest <= max(st.READ_PIECE_BYTES, per_share[0] // st.PIECES_PER_SHARE + st.PAGE_BYTES)
    assert (
        longest <= st.READ_PIECE_BYTES or per_share[0] > st.PIECES_PER_SHARE * st.READ_PIECE_BYTES
    )


@pytest.mark.parametrize("name", MODELS)
def test_convert_plan_layout_and_layer_files(checkpoints, tmp_path, monkeypatch, name):
    """``convert`` at real scale, writing holes instead of bytes except for one expert layer of
    Qwen3-30B-A3B (340 MB, written for real and read back): the layout, the config's moeflux
    section, the dense shards and index, every layer file's size, and the converted store's
    offsets (expert e at e x blob)."""
    src = checkpoints[name]
    layout = scan_checkpoint(src).layout
    real_layer = max(layout.layers) if name == "Qwen3-30B-A3B" else None
    write_layer = convert_module._write_layer

    def sparse_safetensors(out, tensors, bar):
        realscale._write_header(out, {n: (r.dtype, r.shape, r.nbytes) for n, r in tensors.items()})

    def sparse_layer(ckpt, layer, lay, out, bar):
        if layer == real_layer:
            return write_layer(ckpt, layer, lay, out, bar)
        with open(out, "wb") as f:
            f.truncate(lay.layer_bytes)
        # a hole reads as zeros: each expert's checksum is that of a zero blob
        return np.full(lay.num_experts, zlib.crc32(bytes(lay.blob_size)), np.uint32)

    monkeypatch.setattr(convert_module, "_write_safetensors", sparse_safetensors)
    monkeypatch.setattr(convert_module, "_write_layer", sparse_layer)
    monkeypatch.setattr(convert_module, "_fsync_tree", lambda work: None)
    if real_layer is not None:
        n = layout.layers[real_layer].num_experts
        experts = [0, 1, n // 2, n - 1]
        written = _markers(src, layout, (real_layer,), experts)
    dst = convert(src, tmp_path / "packed", progress=False)
    try:
        assert packed_layout(dst).to_dict() == layout.to_dict()
        assert check_packed(dst).total_expert_bytes == layout.total_expert_bytes
        section = json.loads((dst / "config.json").read_text())["moeflux"]
        assert section["moe_layers"] == sorted(layout.layers)
        assert section["total_expert_bytes"] == layout.total_expert_bytes
        for layer, lay in layout.layers.items():
            assert packed_file(dst, layer).stat().st_size == lay.num_experts * lay.blob_size
        dense = scan_checkpoint(src).dense
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(dense)
        assert index["metadata"]["total_size"] == sum(r.nbytes for r in dense.values())
        store, _ = open_store(dst, "pread")
        with store:
            for layer in (min(layout.layers), max(layout.layers)):
                lay = layout.layers[layer]
                e = lay.num_experts - 1
                assert store.layers[layer].pieces(e)[0][1:4] == (
                    e * lay.blob_size,
                    0,
                    lay.blob_size,
                )
            if real_layer is not None:
                lay = layout.layers[real_layer]
                blobs = store.read(real_layer, np.array(experts))
                for i, e in enumerate(experts):
                    _check_blob(blobs[i], lay, real_layer, e, written)
    finally:
        import shutil

        shutil.rmtree(dst)


LOAD = textwrap.dedent("""
    import gc, json, sys, psutil, mlx.core as mx, moeflux_mlx
    from transformers import PretrainedConfig
    out = {}
    for path in sys.argv[1:]:
        gc.collect()
        model, _ = moeflux_mlx.load(
            path, lazy=True, cache_budget=0,
            tokenizer_config={"config": PretrainedConfig()},  # the stand-in tokenizer's
        )
        rt = model.moeflux
        out[path] = dict(
            rss=psutil.Process().memory_info().rss,
            mlx=mx.get_active_memory(),
            peak=mx.get_peak_memory(),
            experts=rt.layout.total_expert_bytes,
            io=rt.store.io_mode,
            layers=len(rt.layout.layers),
        )
        rt.close()
        del model, rt
    print(json.dumps(out))
""")


def test_load_costs_no_memory_for_the_experts(checkpoints):
    """``load`` (store opened, the model built by mlx-lm with every experts module replaced,
    the dense weights lazy) of 16 GB to 1.1 TB of experts, in one fresh process: MLX allocates
    nothing and the process grows by a few MB, not with the experts."""
    paths = [str(checkpoints[n]) for n in MODELS]
    out = subprocess.run(
        [sys.executable, "-c", LOAD, *paths], capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    sizes = {p: got[p]["experts"] for p in paths}
    assert max(sizes.values()) > 1e12  # a terabyte of experts
    rss = [got[p]["rss"] for p in paths]
    for p, g in got.items():
        print(
            f"{os.path.basename(p)}: {g['experts'] / 1e9:.0f} GB of experts, RSS {g['rss'] / 1e6:.0f} MB"
        )
    for p in paths:
        assert got[p]["peak"] < 1 << 20, (p, got[p])  # MLX allocated nothing
    assert max(rss) - min(rss) < 200e6, rss  # vs 1.1 TB - 16 GB of experts
