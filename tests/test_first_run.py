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
