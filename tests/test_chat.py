"""The chat loop, driven as a person would (pseudo-terminal), and its prompt cache."""

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pexpect
import pytest

import moeflux_mlx
from moeflux_mlx import demo_model
from moeflux_mlx.commands.chat import ChatSession
from tests.support import synth

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "chat.py"
TIMEOUT = 90
STATS = re.compile(
    r"\[prompt: (\d+) tokens \((\d+) cached\), [\d.]+ tok/s \| "
    r"reply: (\d+) tokens, [\d.]+ tok/s \| peak memory [\d.]+ \w?B \| "
    r"experts: [\d.]+ \w?B read, hit rate [\d.]+%(?:, \d+ of \d+ layer calls all resident)? "
    r"\((mmap|pread)\)\]"
)
PROMPT_LOG = re.compile(
    r"prompt: (\d+) tokens, (\d+) of them reused from the prompt cache, "
    r"(\d+) new"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return synth.build_checkpoint(root / "qwen3_moe", "qwen3_moe", "tiny")


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO), TERM="dumb", HF_HUB_OFFLINE="1")


def _turn(child, message):
    """Send a message; return (reply text, prompt log numbers, stats numbers)."""
    child.sendline(message)
    child.expect(PROMPT_LOG)
    logged = tuple(map(int, child.match.groups()))
    child.expect(STATS)
    stats = child.match.groups()
    reply = child.before.strip()
    child.expect_exact(">> ")
    return reply, logged, stats


def test_chat_in_a_terminal(tiny):
    child = pexpect.spawn(
        sys.executable,
        [str(EXAMPLE), "--model", str(tiny), "-m", "16", "--verbose"],
        env=_env(),
        cwd=str(REPO),
        encoding="utf-8",
        timeout=TIMEOUT,
    )
    try:
        child.expect_exact(">> ")
        reply1, (total1, reused1, new1), stats1 = _turn(child, "Hello, who are you?")
        assert reply1
        assert reused1 == 0 and new1 == total1 == int(stats1[0])
        assert 1 <= int(stats1[2]) <= 16

        # The second turn renders the whole conversation but feeds only what the cache lacks:
        # at least all of turn 1's prompt comes from the cache. (Of the reply, what the template
        # re-renders with the same tokens: random-weight text often re-tokenizes differently.)
        reply2, (total2, reused2, new2), stats2 = _turn(child, "Tell me more about that.")
        assert reply2
        assert reused2 >= total1 and new2 == total2 - reused2
        assert total2 > total1 + len("Tell me more")  # the conversation grew
        assert (int(stats2[0]), int(stats2[1])) == (new2, reused2)

        child.sendline("/reset")
        child.expect_exact("Conversation reset.")
        child.expect_exact(">> ")
        _, (total3, reused3, new3), _ = _turn(child, "Hello, who are you?")
        assert reused3 == 0 and total3 == new3 == total1

        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


@pytest.mark.parametrize("quit_with", ["q", "eof"])
def test_chat_quits(tiny, quit_with):
    child = pexpect.spawn(
        sys.executable,
        [str(EXAMPLE), "--model", str(tiny)],
        env=_env(),
        cwd=str(REPO),
        encoding="utf-8",
        timeout=TIMEOUT,
    )
    try:
        child.expect_exact(">> ")
        if quit_with == "eof":
            child.sendeof()
        else:
            child.sendline("q")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_one_shot_prompt(tiny):
    r = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--model",
            str(tiny),
            "--prompt",
            "Hi there",
            "--max-tokens",
            "8",
            "--temp",
            "0.7",
            "--top-p",
            "0.9",
            "--seed",
            "3",
            "--expert-io",
            "pread",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    m = STATS.search(r.stderr)
    assert m, r.stderr
    assert m[2] == "0" and 1 <= int(m[3]) <= 8 and m[4] == "pread"
    assert ">> " not in r.stdout  # no interactive loop


def test_no_model_uses_the_demo():
    env = _env()
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), "--prompt", "Hi", "-m", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stderr
    assert "using the built-in demo model" in r.stderr
    assert str(demo_model.checkpoint_path()) in r.stderr
    assert STATS.search(r.stderr)


def test_bad_model_is_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), "--model", str(tmp_path), "--prompt", "Hi"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=TIMEOUT,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("moeflux-mlx: error: ")


# --------------------------------------------------------------------------- ChatSession


def _say(session, text, n=8, **kwargs):
    with contextlib.closing(session.send(text, max_tokens=n, **kwargs)) as stream:
        return [r.token for r in stream]


def _cache_len(session):
    return max(c.offset for c in session.cache if hasattr(c, "offset"))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_session_cache_holds_exactly_the_conversation(arch, tmp_path):
    """After each turn the KV cache holds exactly the tokens the session believes it holds,
    also after a diverging history (trimmed; or re-read for recurrent layers, not trimmable)."""
    path = synth.build_checkpoint(tmp_path / arch, arch, "tiny")
    model, tokenizer = moeflux_mlx.load(path)
    try:
        s = ChatSession(model, tokenizer, system_prompt="Be brief.")
        generated = _say(s, "Hello")
        assert s.reused_tokens == 0
        assert s.cached[-len(generated) :] == generated
        assert _cache_len(s) == len(s.cached)
        first = len(s.cached)

        _say(s, "And then?")
        assert s.reused_tokens >= first - len(generated)
        assert _cache_len(s) == len(s.cached)

        s.messages[-1]["content"] = "Something the model never said."
        _say(s, "Really?")
        if arch == "qwen3_moe":  # the diverging reply was trimmed off, the rest reused
            assert 0 < s.reused_tokens < len(s.cached)
        else:
            assert s.reused_tokens == 0
        assert _cache_len(s) == len(s.cached)

        s.reset()
        assert s.cached == [] and _cache_len(s) == 0 and s.messages[0]["role"] == "system"
    finally:
        model.moeflux.close()


def test_session_reuses_a_reply_that_re_renders_identically(tmp_path):
    """A reply whose text re-tokenizes to the tokens generated (as real models' replies do) is
    reused whole: the second turn feeds only the template's turn separator and the new message."""
    path = synth.build_checkpoint(tmp_path / "m", "qwen3_moe", "tiny")
    model, tokenizer = moeflux_mlx.load(path)
    try:
        eos = tokenizer.eos_token_ids
        forced = iter(tokenizer.encode("Hello there, how can I help?") + sorted(eos)[:1])

        def force(tokens, logits):  # a model that says exactly this (then anything: unused)
            t = next(forced, None)
            if t is None:
                return logits
            return mx.where(mx.arange(logits.shape[-1]) == t, 0.0, -1e9)[None]

        s = ChatSession(model, tokenizer)
        generated = _say(s, "Hi", n=50, logits_processors=[force])
        assert generated[-1] in eos
        assert tokenizer.decode(generated[:-1]) == s.messages[-1]["content"]
        held = len(s.cached)

        _say(s, "Tell me about the sea.")
        assert s.reused_tokens == held
        suffix = tokenizer.encode(
            "\n<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n"
        )
        assert s.new_tokens == len(suffix)
        assert _cache_len(s) == len(s.cached)
    finally:
        model.moeflux.close()


def test_session_forgets_an_interrupted_turn(tmp_path):
    path = synth.build_checkpoint(tmp_path / "m", "qwen3_moe", "tiny")
    model, tokenizer = moeflux_mlx.load(path)
    try:
        s = ChatSession(model, tokenizer)
        _say(s, "Hello")
        messages = list(s.messages)
        stream = s.send("Tell me a long story", max_tokens=50)
        next(stream)
        stream.close()  # what Ctrl-C during a reply does
        assert s.messages == messages
        assert s.cached == [] and _cache_len(s) == 0
        _say(s, "Hello again")
        assert _cache_len(s) == len(s.cached)
    finally:
        model.moeflux.close()
