"""``cache_budget="auto"``: the hit-rate curve, where it is kept, and the budget picked from it."""

from __future__ import annotations

import json
import logging
import os
import stat
from types import SimpleNamespace

import pytest

import moeflux_mlx
from moeflux_mlx import cli, options
from moeflux_mlx.cache import curve as C
from moeflux_mlx.cache.policy import POLICIES
from moeflux_mlx.commands import common
from moeflux_mlx.errors import CurveError, OptionError
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.model.calibrate import calibrate
from moeflux_mlx.options import LoadOptions, parse_budget
from tests.support import synth


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    """Curves that cannot go beside a model go to a temporary user cache, not ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return synth.build_checkpoint(
        tmp_path_factory.mktemp("auto") / "m", "qwen3_moe", "tiny", seed=4
    )


@pytest.fixture(scope="module")
def recorded(model_dir):
    """The tiny model's curve, recorded once with a made-up timing where reads dominate."""
    model, tokenizer = moeflux_mlx.load(model_dir)
    with model.moeflux:
        return calibrate(model, tokenizer, model_dir, timing=C.Timing(1e6, 0.001, "warm"))


def _small_ram(monkeypatch, total_bytes: int) -> None:
    """Physical RAM such that the default budget (0.4 x RAM) is ``total_bytes`` x 0.4."""
    ram = SimpleNamespace(total=total_bytes, available=total_bytes)
    monkeypatch.setattr(options, "psutil", SimpleNamespace(virtual_memory=lambda: ram))


def _curve(hits) -> C.HitCurve:
    return C.HitCurve(C.SHARES, {"transition": hits}, [16], 4, 10**9, 100, C.Timing(1e9, 0.010))


# --------------------------------------------------------------------------- the curve


def test_recorded_curve_rises_to_one_and_is_kept_beside_the_model(recorded, model_dir):
    h = recorded.hit_rates["transition"]
    assert len(h) == len(C.SHARES) and h[0] == 0.0 and h[-1] == 1.0
    assert all(a <= b for a, b in zip(h, h[1:]))
    assert 0 < h[len(h) // 2] < 1  # half the experts: some hits, not all
    assert recorded.path == model_dir / C.CURVE_FILE
    assert C.find_curve(model_dir) == recorded  # read back as written
    assert recorded.fits(expert_layout(model_dir), 4)


def test_a_layer_with_fewer_slots_than_a_token_routes_never_hits():
    import numpy as np

    rows = np.array([[0, 1, 2, 3], [4, 5, 6, 7]] * 8)
    assert C.layer_hits(rows, 16, 3, POLICIES["lru"]) == 0.0
    assert C.layer_hits(rows, 16, 16, POLICIES["lru"]) == 1.0
    assert C.layer_hits(rows, 16, 8, POLICIES["lru"]) == 1.0  # both rows fit


# --------------------------------------------------------------------------- the pick


def test_auto_picks_the_knee():
    # hit rate climbs to 98% at 30% of the experts, then barely moves
    hits = [min(0.98, 0.98 * s / 0.3) for s in C.SHARES[:-2]] + [0.99, 1.0]
    chosen = C.pick(_curve(hits), "transition", int(0.6 * 10**9), 1e8, C.Timing(1e9, 0.010))
    assert chosen.bytes == int(0.3 * 10**9) and chosen.auto


def test_auto_without_a_knee_takes_the_most_it_may():
    hits = list(C.SHARES)  # n / E: every 5% buys as much as the last
    chosen = C.pick(_curve(hits), "transition", int(0.6 * 10**9), 1e8, C.Timing(1e9, 0.010))
    assert chosen.bytes == int(0.6 * 10**9)


def test_auto_is_all_where_every_expert_fits(model_dir):
    layout = expert_layout(model_dir)
    chosen = C.resolve_budget("auto", layout, None, "transition")  # no curve needed
    assert chosen.bytes == layout.total_expert_bytes and chosen.auto
    assert "every expert" in chosen.why


def test_auto_reads_the_recorded_curve_and_never_calibrates_at_load(
    recorded, model_dir, monkeypatch
):
    layout = expert_layout(model_dir)
    _small_ram(monkeypatch, layout.total_expert_bytes)  # the default: 40% of the experts

    def no(*a, **k):
        raise AssertionError("a load simulated routing")

    monkeypatch.setattr(C, "simulate", no)
    model, _ = moeflux_mlx.load(model_dir, cache_budget="auto")
    with model.moeflux as rt:
        ceiling = parse_budget(None, layout.total_expert_bytes)
        assert rt.budget.auto and str(recorded.path) in rt.budget.why
        routed = sum(4 * lay.blob_size for lay in layout.layers.values())
        expected = C.pick(recorded, "transition", ceiling, routed, recorded.timing)
        assert rt.budget.bytes == expected.bytes <= ceiling
        assert rt.cache.slots.budget_bytes == expected.bytes


def test_auto_without_a_curve_is_the_default_and_says_how_to_record_one(
    tmp_path, monkeypatch, caplog
):
    src = synth.build_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=5)
    layout = expert_layout(src)
    _small_ram(monkeypatch, layout.total_expert_bytes)
    with caplog.at_level(logging.WARNING, "moeflux_mlx"):
        chosen = C.resolve_budget("auto", layout, src, "transition")
    assert chosen.bytes == parse_budget(None, layout.total_expert_bytes)
    assert "moeflux-mlx doctor MODEL" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "other format", "not a rate"])
def test_a_damaged_curve_file_is_named_and_auto_falls_back(
    recorded, tmp_path, monkeypatch, caplog, damage
):
    src = tmp_path / "m"
    src.mkdir()
    text = recorded.path.read_text()
    if damage == "truncated":
        text = text[: len(text) // 2]
    else:
        d = json.loads(text)
        if damage == "other format":
            d["format"] = 99
        else:
            d["hit_rates"]["transition"][3] = 1.5
        text = json.dumps(d)
    bad = src / C.CURVE_FILE
    bad.write_text(text)
    with pytest.raises(CurveError, match=str(bad)):
        C.read_curve(bad)
    layout = expert_layout(recorded.path.parent)
    _small_ram(monkeypatch, layout.total_expert_bytes)
    with caplog.at_level(logging.WARNING, "moeflux_mlx"):
        chosen = C.resolve_budget("auto", layout, src, "transition")
    assert chosen.bytes == parse_budget(None, layout.total_expert_bytes)
    assert str(bad) in caplog.text and len(caplog.records) == 1


def test_a_curve_for_another_model_is_not_used(recorded, monkeypatch, caplog):
    layout = expert_layout(recorded.path.parent)
    other = C.HitCurve(**{**vars(recorded), "total_expert_bytes": 1})
    monkeypatch.setattr(C, "find_curve", lambda d: other)
    _small_ram(monkeypatch, layout.total_expert_bytes)
    with caplog.at_level(logging.WARNING, "moeflux_mlx"):
        chosen = C.resolve_budget("auto", layout, recorded.path.parent, "transition")
    assert "another model" in caplog.text
    assert chosen.bytes == parse_budget(None, layout.total_expert_bytes)


def test_write_falls_back_to_the_user_cache_and_leaves_no_temporary_file(recorded, tmp_path):
    src = tmp_path / "m"
    (src / C.CURVE_FILE).mkdir(parents=True)  # the model directory's file cannot be replaced
    path = C.write_curve(src, recorded)
    assert path.parent == tmp_path / "xdg" / "moeflux-mlx" / "curves"
    assert C.find_curve(src).hit_rates == recorded.hit_rates
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert [p.name for p in src.iterdir()] == [C.CURVE_FILE]  # no temporary file left


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_written_curve_has_the_mode_of_a_normal_file(recorded, tmp_path, umask):
    """Readable by the other users of a shared model directory unless the umask says not."""
    src = tmp_path / "m"
    src.mkdir()
    old = os.umask(umask)
    try:
        path = C.write_curve(src, recorded)
    finally:
        os.umask(old)
    assert path == src / C.CURVE_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~umask


def _age(path, seconds: int) -> None:
    t = path.stat().st_mtime - seconds
    os.utime(path, (t, t))


def test_the_newest_curve_wins_where_both_places_hold_one(recorded, tmp_path, caplog):
    src = tmp_path / "m"
    src.mkdir()
    beside, cached = C.curve_paths(src)
    C.write_curve(src, recorded)
    old_text = beside.read_text()
    newer = C.HitCurve(**{**vars(recorded), "tokens": recorded.tokens + 1})
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps(newer.to_json()))
    _age(beside, 60)
    assert C.find_curve(src).tokens == newer.tokens and C.find_curve(src).path == cached
    _age(cached, 120)  # now the model directory's is newer
    assert C.find_curve(src).path == beside
    beside.write_text(old_text[:20])  # a damaged newer file does not hide a good older one
    with caplog.at_level(logging.WARNING, "moeflux_mlx"):
        assert C.find_curve(src).path == cached
    assert str(beside) in caplog.text
    cached.unlink()
    with pytest.raises(CurveError, match=str(beside)):
        C.find_curve(src)


def test_a_curve_recorded_where_the_model_directory_is_read_only_is_the_one_read(
    recorded, tmp_path, monkeypatch
):
    """The old curve beside the model can be neither replaced nor removed: the new one goes to
    the user cache, and loads read it, as doctor printed it."""
    src = tmp_path / "m"
    src.mkdir()
    beside, cached = C.curve_paths(src)
    C.write_curve(src, recorded)
    _age(beside, 60)
    real_replace, real_unlink = C._replace_atomically, os.unlink

    def replace(path, text):
        if path == beside:
            raise PermissionError(13, "Permission denied", str(path))
        real_replace(path, text)

    def unlink(path, *a, **k):
        if os.fspath(path) == str(beside):
            raise PermissionError(13, "Permission denied", str(path))
        real_unlink(path, *a, **k)

    monkeypatch.setattr(C, "_replace_atomically", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    newer = C.HitCurve(**{**vars(recorded), "tokens": recorded.tokens + 1})
    assert C.write_curve(src, newer) == cached
    assert beside.is_file()  # still there: it could not be removed
    assert C.find_curve(src).tokens == newer.tokens


def _lru(curve: C.HitCurve, **changes) -> C.HitCurve:
    """``curve`` as the lru policy's, with ``changes`` (another model's, say)."""
    return C.HitCurve(
        **{**vars(curve), "hit_rates": {"lru": curve.hit_rates["transition"]}, **changes}
    )


@pytest.mark.parametrize(
    "changes", [{"total_expert_bytes": 1}, {"top_k": 2}, {"num_experts": [8, 8]}]
)
def test_writing_drops_the_curves_of_another_model(recorded, tmp_path, changes):
    src = tmp_path / "m"
    src.mkdir()
    C.write_curve(src, _lru(recorded, **changes))
    C.write_curve(src, recorded)
    assert set(C.find_curve(src).hit_rates) == {"transition"}


def test_writing_keeps_the_same_models_curves_of_other_policies(recorded, tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    C.write_curve(src, _lru(recorded, timing=None))
    without_timing = C.HitCurve(**{**vars(recorded), "timing": None})
    C.write_curve(src, without_timing)
    found = C.find_curve(src)
    assert set(found.hit_rates) == {"lru", "transition"}
    assert found.timing is None  # neither recorded one
    C.write_curve(src, recorded)
    assert C.find_curve(src).timing == recorded.timing


def test_doctor_shows_the_budget_a_load_chooses(recorded, model_dir, monkeypatch):
    from moeflux_mlx.commands import doctor

    layout = expert_layout(model_dir)
    _small_ram(monkeypatch, layout.total_expert_bytes)
    chosen = C.resolve_budget("auto", layout, model_dir, "transition")
    assert str(recorded.path) in chosen.why and "GB/s: warm" in chosen.why
    rows = dict(doctor.curve_rows(recorded, "transition", layout, recorded.top_k))
    assert rows["cache budget auto"] == f"{common.fmt_bytes(chosen.bytes)}: {chosen.why}"


# --------------------------------------------------------------------------- the option


def test_auto_is_a_budget_everywhere_but_parse_budget(model_dir, capsys):
    assert LoadOptions.resolve(cache_budget=" AUTO ").cache_budget == " AUTO "
    with pytest.raises(OptionError, match="curve"):
        parse_budget("auto", 10)
    assert common._budget("auto") == "auto"
    assert cli.main(["info", str(model_dir), "--cache-budget", "auto"]) == 0
    out = capsys.readouterr().out
    assert "--cache-budget auto: every expert" in out


def test_generate_loads_with_auto_and_says_what_it_chose(model_dir, capsys):
    argv = ["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2"]
    assert cli.main(argv + ["--cache-budget", "auto"]) == 0
    assert "(auto: every expert" in capsys.readouterr().err
