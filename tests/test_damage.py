"""Damage to a converted directory is repaired by ``convert`` or caught by the store, never
turned into text: convert records a CRC-32 per expert blob, checks them (and the sizes) when run
over its own conversion, and the store checks each expert at its first read."""

import json
import shutil

import numpy as np
import pytest

from moeflux_mlx import cli
from moeflux_mlx.errors import ExpertChecksumError
from moeflux_mlx.format.checkpoint import LAYOUT_FILE, PACKED_DIR, packed_file
from moeflux_mlx.format.convert import convert
from moeflux_mlx.io.store import open_store
from tests.support import synth


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return synth.build_checkpoint(tmp_path_factory.mktemp("damage") / "src", "qwen3_moe", "tiny")


@pytest.fixture
def packed(source, tmp_path):
    return convert(source, tmp_path / "packed", progress=False)


def _blob_size(packed, layer=0):
    d = json.loads((packed / PACKED_DIR / LAYOUT_FILE).read_text())
    return d["layers"][str(layer)]["blob_size"]


def _garble(packed, layer, expert):
    """Overwrite bytes inside one expert's blob: same file size, other bytes."""
    size = _blob_size(packed, layer)
    with open(packed_file(packed, layer), "r+b") as f:
        f.seek(expert * size + 16)
        old = f.read(64)
        f.seek(expert * size + 16)
        f.write(bytes(b ^ 0x5A for b in old))


def test_clean_conversion_again_is_nothing_to_do(source, packed, capsys):
    before = {p.name: p.read_bytes() for p in (packed / PACKED_DIR).iterdir()}
    assert cli.main(["convert", str(source), str(packed), "-q"]) == 0
    err = capsys.readouterr().err
    assert "Nothing to do" in err and "sizes and checksums" in err, err
    assert before == {p.name: p.read_bytes() for p in (packed / PACKED_DIR).iterdir()}


def test_convert_repairs_a_truncated_layer_file(source, packed, capsys):
    path = packed_file(packed, 1)
    good = path.read_bytes()
    with open(path, "r+b") as f:
        f.truncate(len(good) // 3)
    assert cli.main(["convert", str(source), str(packed), "-q"]) == 0
    err = capsys.readouterr().err
    assert "Repaired" in err and f"{path.name} (layer 1: " in err and "expected" in err, err
    assert path.read_bytes() == good
    assert cli.main(["generate", "--model", str(packed), "-m", "4"]) == 0


def test_convert_repairs_same_size_damage(source, packed, capsys):
    path = packed_file(packed, 0)
    good = path.read_bytes()
    _garble(packed, 0, 3)
    assert cli.main(["convert", str(source), str(packed), "-q"]) == 0
    err = capsys.readouterr().err
    assert f"rewrote 1 damaged layer file: {path.name} (layer 0: 1 expert" in err, err
    assert "expert 3" in err and path.read_bytes() == good


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_generate_stops_on_same_size_damage(packed, io, capsys):
    _garble(packed, 0, 2)
    rc = cli.main(["generate", "--model", str(packed), "-m", "4", "--expert-io", io])
    out, err = capsys.readouterr()
    assert rc == 2
    lines = [line for line in err.splitlines() if line.startswith("moeflux-mlx: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(packed_file(packed, 0)) in lines[0] and "layer 0, expert 2" in lines[0], lines
    assert out.strip() == ""  # no text from damaged weights


def test_store_checks_each_expert_once(packed, monkeypatch):
    store, _ = open_store(packed, "pread")
    try:
        calls = []
        real = store._check
        monkeypatch.setattr(store, "_check", lambda *a: calls.append(a[0]) or real(*a))
        store.read(0, np.array([1, 5]))
        assert 0 in store._unchecked and store._unchecked[0][[1, 5]].all()
        n = store.layout(0).num_experts
        store.read(0, np.arange(n))  # every expert now checked: the layer leaves the map
        assert 0 not in store._unchecked
        store.read(0, np.array([1, 5]))
        assert calls == [0, 0]  # the third read checked nothing
        _garble(packed, 0, 1)  # damage after the first read is not looked for again
        store.read(0, np.array([1]))
    finally:
        store.close()
    store, _ = open_store(packed, "pread")
    try:
        with pytest.raises(ExpertChecksumError, match="layer 0, expert 1"):
            store.read(0, np.array([1]))
    finally:
        store.close()


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_store_counts_what_first_reads_cost_and_re_reads_nothing(packed, io):
    store, _ = open_store(packed, io)
    try:
        size = store.layout(0).blob_size
        assert store.checksum_cost() == (0.0, 0)
        store.read(0, np.array([1, 5]))
        s, nbytes = store.checksum_cost()
        assert s > 0 and nbytes == 2 * size
        store.read(0, np.array([1, 5, 6]))  # only expert 6 is new
        s, nbytes = store.checksum_cost()
        assert nbytes == 3 * size
        one = np.empty(size, np.uint8)
        store.read(0, np.array([1, 5, 6]))
        store.read_one(0, 6, one)
        assert store.checksum_cost() == (s, nbytes)  # re-reads of checked experts: no cost
        store.read_one(0, 7, one)
        store.read(1, np.array([0]))
        assert store.checksum_cost()[1] == nbytes + size + store.layout(1).blob_size
        assert store.checksum_cost()[0] > s
    finally:
        store.close()


def test_plain_checkpoints_are_not_checked(source, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(source, plain)
    store, _ = open_store(plain, "pread")
    try:
        assert store._unchecked == {}  # no recorded checksums: nothing to check against
        store.read(0, np.array([0, 1]))
        assert store.checksum_cost() == (0.0, 0)
    finally:
        store.close()
