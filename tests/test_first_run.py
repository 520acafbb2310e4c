"""What a new user meets first, said plainly: a model folder without its tokenizer, a cache
budget too small for one token's experts, and the hit rate of a model that is all resident."""

import os

import pytest

import moeflux_mlx
from moeflux_mlx.errors import CheckpointError, MissingTokenizerError
from tests.support import synth
from tests.test_cli_errors import one_line_error, run_cli

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """A plain tiny qwen3_moe checkpoint whose tokenizer files were deleted."""
    path = synth.build_checkpoint(tmp_path_factory.mktemp("first-run") / "m", "qwen3_moe", "tiny")
    for name in TOKENIZER_FILES:
        os.remove(path / name)
    return path


# --------------------------------------------------------------------------- no tokenizer


def test_load_without_tokenizer_says_so(no_tokenizer):
    with pytest.raises(MissingTokenizerError) as e:
        moeflux_mlx.load(no_tokenizer)
    assert isinstance(e.value, CheckpointError)
    msg = str(e.value)
    assert "\n" not in msg and str(no_tokenizer) in msg and "no tokenizer" in msg
    assert "tokenizer.json" in msg and "tokenizer_config.json" in msg
    assert "copy the tokenizer files" in msg and "mlx_lm.convert" in msg


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "-p", "hello", "--max-tokens", "2"],
        ["chat", "--max-tokens", "2"],
        ["server", "--port", "0"],
    ],
    ids=lambda c: c[0],
)
def test_commands_without_tokenizer_say_so(no_tokenizer, command):
    r = run_cli(*command[:1], "--model", no_tokenizer, *command[1:], stdin="hi\n", timeout=120)
    line = one_line_error(r)
    assert "no tokenizer" in line and "tokenizer.json" in line, line
    assert "copy the tokenizer files" in line, line
    assert "prompt is empty" not in line and "please report it" not in line, line
    assert "Serving" not in r.stderr


# --------------------------------------------------------------------------- a budget too small


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A plain tiny qwen3_moe checkpoint (2 MoE layers of 16 experts, top-k 4)."""
    return synth.build_checkpoint(tmp_path_factory.mktemp("first-run") / "t", "qwen3_moe", "tiny")


def _layout(path):
    from moeflux_mlx.format.checkpoint import scan_checkpoint

    return scan_checkpoint(path).layout


def test_smallest_budget_is_the_least_that_holds_top_k(tiny):
    from moeflux_mlx.cache.slots import slots_per_layer, smallest_budget, too_small

    layout = _layout(tiny)
    need = smallest_budget(layout, 4)
    assert min(slots_per_layer(layout, need).values()) == 4
    assert min(slots_per_layer(layout, need - 1).values()) == 3
    assert too_small(layout, need, 4) is None and too_small(layout, 0, 4) is None
    short = too_small(layout, need - 1, 4)
    assert (short.fewest, short.most, short.top_k, short.at_least) == (3, 3, 4, need)


def test_load_warns_once_when_the_budget_cannot_hold_one_token(tiny, caplog):
    import mlx.core as mx

    with caplog.at_level("WARNING", logger="moeflux_mlx"):
        model, _ = moeflux_mlx.load(tiny, cache_budget="15% experts")
    warned = [r.getMessage() for r in caplog.records if "top-k" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert warned[0].startswith("cache budget 15% experts (132.71 kB): ")
    assert "2 slots per layer < top-k 4" in warned[0]
    assert "behaves as 0" in warned[0] and "at least 221.18 kB" in warned[0]
    # as the warning says: no call finds a slot; every one is staged (the cache is unchanged)
    model(mx.array([[1, 2, 3]]))
    rt = model.moeflux
    assert rt.cache.slots.n_slots == {0: 2, 1: 2} and not rt.cache.slots.pools
    rt.close()

    caplog.clear()
    with caplog.at_level("WARNING", logger="moeflux_mlx"):
        moeflux_mlx.load(tiny, cache_budget="25% experts")[0].moeflux.close()
        moeflux_mlx.load(tiny, cache_budget=0)[0].moeflux.close()
    assert not [r for r in caplog.records if "top-k" in r.getMessage()]


def test_info_says_the_budget_behaves_as_zero(tiny):
    from moeflux_mlx.commands import info

    row = dict(info.describe(tiny, {"cache_budget": "110591B"}))["expert cache"]
    assert "(12% of them" in row
    assert "1 slot per layer < top-k 4: too small for one token's experts: behaves as 0" in row
    assert row.endswith("at least 221184 B")
    row = dict(info.describe(tiny, {"cache_budget": "221184B"}))["expert cache"]
    assert "top-k" not in row


# --------------------------------------------------------------------------- an honest hit rate


def _calls(model, *token_rows):
    import mlx.core as mx

    for row in token_rows:
        mx.eval(model(mx.array([row])))


def test_resident_model_hit_rate_counts_its_hits(tiny):
    from moeflux_mlx.commands.common import expert_summary

    model, _ = moeflux_mlx.load(tiny, cache_budget="all")
    try:
        _calls(model, [1, 2, 3, 4, 5])  # the first call of each layer reads it whole
        fill = moeflux_mlx.stats(model)["total"]
        assert fill["hit_rate"] == 0.0 and fill["experts_missed"] == fill["experts_routed"] > 0
        _calls(model, [6], [7], [8])  # decode-sized calls: 4 selections = 4 experts, all hits
        t = moeflux_mlx.stats(model)["total"]
        layers = len(model.moeflux.layout.layers)
        assert t["experts_routed"] == fill["experts_routed"] + 3 * 4 * layers
        assert t["experts_missed"] == fill["experts_missed"]
        assert t["hit_rate"] == pytest.approx(1 - t["experts_missed"] / t["experts_routed"])
        assert t["hit_rate"] > 0.5
        line = expert_summary(moeflux_mlx.stats(model))
        assert f"hit rate {100 * t['hit_rate']:.1f}%, {3 * layers} of {4 * layers} layer calls" in (
            line
        )
        moeflux_mlx.reset_stats(model)
        _calls(model, [9], [10, 11])  # resident now: nothing missed, nothing read
        t = moeflux_mlx.stats(model)["total"]
        assert t["hit_rate"] == 1.0 and t["bytes_read"] == 0
        assert t["experts_routed"] == 3 * 4 * layers
        assert "hit rate 100.0%" in expert_summary(moeflux_mlx.stats(model))
    finally:
        model.moeflux.close()


def test_partly_cached_hit_rate_is_unchanged(tiny):
    from moeflux_mlx.commands.common import expert_summary

    model, _ = moeflux_mlx.load(tiny, cache_budget="50% experts")
    try:
        assert moeflux_mlx.stats(model)["total"]["hit_rate"] is None  # nothing counted yet
        _calls(model, [1, 2, 3], [4], [5], [6], [7], [4], [5])
        t = moeflux_mlx.stats(model)["total"]
        assert t["unsynced_calls"] == 0 and 0 < t["experts_missed"] < t["experts_routed"]
        assert 0 < t["hit_rate"] < 1
        line = expert_summary(moeflux_mlx.stats(model))
        assert f"hit rate {100 * t['hit_rate']:.1f}% (" in line and "all resident" not in line
    finally:
        model.moeflux.close()


def test_a_budget_is_shown_as_it_was_written():
    """``info`` and the load line show a budget in its own terms: a share names its base."""
    from moeflux_mlx.commands.common import fmt_budget

    total = 4_000_000_000
    assert fmt_budget("25% experts", total) == "1.00 GB (25% experts)"
    assert fmt_budget("all", total) == "4.00 GB (all)"
    assert fmt_budget("8GiB", total).endswith("GiB")
    assert fmt_budget("10%  ram", total).endswith("(10% ram)")  # as typed, spaces tidied


def test_calls_whose_layer_was_read_whole_are_not_counted_resident():
    """A prefill at a small budget reads its layers whole without a host sync: not a layer with
    every expert resident, so the stats line does not call those calls resident."""
    from mlx_lm import generate

    import moeflux_mlx
    from moeflux_mlx.commands.common import expert_summary
    from moeflux_mlx.demo_model import checkpoint_path

    model, tokenizer = moeflux_mlx.load(checkpoint_path(), cache_budget="25% experts")
    with model.moeflux:
        generate(model, tokenizer, " ".join(["once upon a time there was a cat"] * 8), max_tokens=2)
        stats = model.moeflux.stats_dict()
        t = stats["total"]
        assert t["unsynced_calls"] > 0 and t["resident_calls"] == 0
        assert "all resident" not in expert_summary(stats)
