"""``moeflux-mlx generate`` and ``chat`` take mlx-lm's flags, with mlx-lm's meanings: each
command's flags are held against mlx-lm's own parser (a new mlx-lm flag fails here until it is
taken or listed as not taken, with why), and the flags reach mlx-lm's code paths."""

import argparse
import re

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.chat import setup_arg_parser as mlx_chat_parser
from mlx_lm.generate import setup_arg_parser as mlx_generate_parser
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

from moeflux_mlx import cli
from moeflux_mlx.format.convert import convert
from tests.support import synth

# mlx_lm.generate's flags deliberately not taken by ``moeflux-mlx generate``, and why
GENERATE_NOT_TAKEN = {
    # LoRA adapters: the routed experts stream from the packed files, an adapter's expert
    # weights would be ignored; fuse them first (mlx_lm.fuse) and convert the result
    "--adapter-path",
    # vision input: the server takes images (as data: URLs); generate stays text-only
    "--image",
    # mlx_lm.generate parses it and never reads it
    "--use-default-chat-template",
    # activation quantization is a model_config of mlx-lm's own layers: the streamed expert
    # layers compute without it
    "--quantize-activations",
    "-qa",
}
# flags of both whose meaning differs (docs/usage.md marks them)
GENERATE_DIFFERENT = {
    # ours: log moeflux_mlx's INFO lines (store_true); mlx-lm's: print the reply only when False
    "--verbose",
}
# mlx_lm.chat's flags deliberately not taken by ``moeflux-mlx chat``, and why
CHAT_NOT_TAKEN = {
    "--adapter-path",  # as for generate: streamed experts take no adapter
}


def _options(parser: argparse.ArgumentParser) -> set:
    return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize(
    "command, mlx_parser, not_taken",
    [
        ("generate", mlx_generate_parser, GENERATE_NOT_TAKEN),
        ("chat", mlx_chat_parser, CHAT_NOT_TAKEN),
    ],
)
def test_commands_take_mlx_lm_flags(command, mlx_parser, not_taken):
    ours, theirs = _options(_subparser(command)), _options(mlx_parser())
    missing = sorted(theirs - ours - not_taken)
    assert not missing, f"mlx_lm.{command} flags that moeflux-mlx {command} lacks: {missing}"
    stale = sorted(not_taken - theirs)
    assert not stale, f"listed as not taken but no longer mlx-lm's: {stale}"
    assert not (not_taken & ours), "a flag both taken and listed as not taken"


def test_generate_defaults_are_mlx_lm_s():
    ours = vars(_subparser("generate").parse_args([]))
    theirs = vars(mlx_generate_parser().parse_args([]))
    # the demo model; logging; seed 0, not None; the prefill step: the model's own (docs)
    differ = {"model", "verbose", "seed", "prefill_step_size"}
    for name, value in theirs.items():
        if name in ours and name not in differ:
            assert ours[name] == value or list(ours[name]) == list(value), name


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("flags")
    src = synth.build_checkpoint(root / "src", "qwen3_moe", "tiny")
    return {"src": src, "packed": convert(src, root / "packed", progress=False)}


PROMPT = "the quick brown fox jumps over the lazy dog and the quick brown cat"


def _generate(capsys, model, *flags):
    rc = cli.main(
        ["generate", "--model", str(model), "-p", PROMPT, "--ignore-chat-template", *flags]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out.rstrip("\n"), err


def _stock(src, **kwargs):
    model, tokenizer = mlx_lm.load(str(src))
    tokens = tokenizer.encode(PROMPT)
    return "".join(
        r.text for r in mlx_lm.stream_generate(model, tokenizer, tokens, max_tokens=12, **kwargs)
    )


def test_max_kv_size_gives_stocks_tokens(models, capsys):
    out, _ = _generate(capsys, models["packed"], "-m", "12", "--max-kv-size", "6")
    assert out == _stock(models["src"], max_kv_size=6)
    assert out != _generate(capsys, models["packed"], "-m", "12")[0]  # the limit took effect


def test_top_k_1_is_greedy(models, capsys):
    greedy, _ = _generate(capsys, models["packed"], "-m", "12")
    top1, _ = _generate(capsys, models["packed"], "-m", "12", "--temp", "1", "--top-k", "1")
    hot, _ = _generate(capsys, models["packed"], "-m", "12", "--temp", "5", "--seed", "3")
    assert top1 == greedy and hot != greedy


def test_min_p_and_kv_bits_reach_mlx_lm(models, capsys):
    greedy, _ = _generate(capsys, models["packed"], "-m", "12")
    # min-p 1 keeps only the most likely token: greedy at any temperature
    minp, _ = _generate(capsys, models["packed"], "-m", "12", "--temp", "5", "--min-p", "1")
    assert minp == greedy
    q, _ = _generate(
        capsys,
        models["packed"],
        "-m",
        "12",
        "--kv-bits",
        "8",
        "--kv-group-size",
        "32",
        "--quantized-kv-start",
        "0",
    )
    assert q == _stock(models["src"], kv_bits=8, kv_group_size=32, quantized_kv_start=0)


def test_draft_model(models, capsys):
    greedy, _ = _generate(capsys, models["packed"], "-m", "12")
    drafted, _ = _generate(
        capsys,
        models["packed"],
        "-m",
        "12",
        "--draft-model",
        str(models["src"]),
        "--num-draft-tokens",
        "2",
    )
    assert drafted == greedy


def test_prompt_cache_file_round_trip(models, capsys, tmp_path):
    """A KV cache of the prompt's first part, saved as mlx_lm.cache_prompt does: generating the
    rest from it gives the whole prompt's reply."""
    import moeflux_mlx

    model, tokenizer = moeflux_mlx.load(models["packed"])
    try:
        head = "the quick brown fox jumps over the lazy dog"
        cache = make_prompt_cache(model)
        model(mx.array(tokenizer.encode(head))[None], cache=cache)
        mx.eval([c.state for c in cache])
        save_prompt_cache(
            str(tmp_path / "cache.safetensors"),
            cache,
            {"model": str(models["packed"]), "tokenizer_config": "{}"},
        )
        tail = PROMPT[len(head) :]
        whole = tokenizer.encode(PROMPT)
        assert whole[: len(tokenizer.encode(head))] == tokenizer.encode(head)  # a clean split
    finally:
        model.moeflux.close()
    full, _ = _generate(capsys, models["packed"], "-m", "8")
    rc = cli.main(
        [
            "generate",
            "--prompt-cache-file",
            str(tmp_path / "cache.safetensors"),
            "-p",
            tail,
            "--ignore-chat-template",
            "-m",
            "8",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.rstrip("\n") == full
    # the cache's model is taken from its metadata; another --model is refused
    rc = cli.main(
        [
            "generate",
            "--prompt-cache-file",
            str(tmp_path / "cache.safetensors"),
            "--model",
            str(models["src"]),
        ]
    )
    assert rc == 2 and "prompt cache was made with" in capsys.readouterr().err


def test_extra_eos_token_stops_the_reply(models, capsys):
    out, _ = _generate(capsys, models["packed"], "-m", "12")
    model, tokenizer = mlx_lm.load(str(models["src"]))
    ids = [
        r.token
        for r in mlx_lm.stream_generate(model, tokenizer, tokenizer.encode(PROMPT), max_tokens=12)
    ]
    third = tokenizer._tokenizer.convert_ids_to_tokens(ids[2])
    stopped, _ = _generate(capsys, models["packed"], "-m", "12", "--extra-eos-token", third)
    assert stopped.strip() == tokenizer.decode(ids[:2]).strip() and len(stopped) < len(out)
    rc = cli.main(["generate", "--model", str(models["packed"]), "--extra-eos-token", "no such"])
    assert rc == 2 and "--extra-eos-token" in capsys.readouterr().err


def test_prefill_progress_lines(models, capsys):
    _, err = _generate(capsys, models["packed"], "-m", "2", "--prefill-step-size", "4")
    lines = re.findall(r"^prompt: (\d+)/(\d+) tokens \(", err, re.M)
    assert len(lines) >= 3 and lines[-1][0] == lines[-1][1], err
    _, err = _generate(capsys, models["packed"], "-m", "2")  # one prefill step: no lines
    assert not re.search(r"^prompt: \d+/", err, re.M)


def test_chat_max_kv_size_and_progress(models, capsys):
    rc = cli.main(
        [
            "chat",
            "--model",
            str(models["packed"]),
            "-p",
            PROMPT,
            "-m",
            "6",
            "--max-kv-size",
            "8",
            "--prefill-step-size",
            "4",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0 and re.search(r"^prompt: \d+/\d+ tokens", err, re.M), err


def test_python_dash_m(models):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "moeflux_mlx", "generate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "--max-kv-size" in r.stdout, r.stderr
