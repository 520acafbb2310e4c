"""``moeflux-mlx server`` is mlx-lm's OpenAI-compatible server on a streaming model."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlx_lm.server as mlx_server
import pytest
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

import moeflux_mlx
from moeflux_mlx import cli
from moeflux_mlx.commands import server as server_command
from moeflux_mlx.commands.common import load_options
from moeflux_mlx.commands.server import (
    PromptLookup,
    StreamingModelProvider,
    has_routed_experts,
    lookup_stream_generate,
)
from moeflux_mlx.format.convert import convert
from tests.support import synth

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 60
STOP_TIMEOUT = 20


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    src = synth.build_checkpoint(root / "qwen3_moe", "qwen3_moe", "tiny")
    return convert(src, root / "qwen3_moe-packed", progress=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _post(url, body, timeout=60):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def _wait_ready(proc, base):
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited early with status {proc.returncode}")
        try:
            status, body = _get(f"{base}/health", timeout=2)
            if status == 200 and json.loads(body)["status"] == "ok":
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    pytest.fail(f"the server was not ready within {READY_TIMEOUT} s")


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)


def _start(packed, port, log, *extra):
    """``moeflux-mlx server`` on ``packed`` in a process of its own, its output in ``log``."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "moeflux_mlx.cli", "server", "--model", str(packed)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--verbose", *extra]
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def test_server_chat_completion(packed, tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moeflux_mlx.cli",
                "server",
                "--model",
                str(packed),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--verbose",
                "--expert-io",
                "pread",
                "--max-tokens",
                "12",
            ],  # the last is mlx_lm.server's own flag, passed through
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            _wait_ready(proc, base)
            status, body = _post(
                f"{base}/v1/chat/completions",
                {
                    "model": "default_model",
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "Hello! How are you today?"}],
                },
            )
            assert status == 200
            reply = json.loads(body)
            assert reply["object"] == "chat.completion"
            message = reply["choices"][0]["message"]
            assert message["role"] == "assistant" and message["content"]
            assert 1 <= reply["usage"]["completion_tokens"] <= 12

            status, body = _post(
                f"{base}/v1/chat/completions",
                {"max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]},
            )
            chunks = [
                json.loads(line[6:])
                for line in body.decode().splitlines()
                if line.startswith("data: {")
            ]
            assert status == 200 and chunks
            assert chunks[0]["object"] == "chat.completion.chunk"
        finally:
            _stop(proc)
    assert proc.poll() is not None
    text = log.read_text()
    # the model was loaded by moeflux_mlx, with the option given on the command line
    assert "loading" in text and "with moeflux_mlx.load" in text, text
    assert re.search(r"expert I/O: pread\b", text), text
    assert proc.returncode == 0, text  # SIGTERM stops it like Ctrl-C


def test_server_bad_model_fails_before_serving(tmp_path, capsys):
    assert cli.main(["server", "--model", str(tmp_path / "missing"), "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "moeflux-mlx: error: " in err


def _server_args(packed, *extra):
    return cli.build_parser().parse_args(["server", "--model", str(packed), *extra])


def test_provider_streams_routed_experts_and_leaves_the_rest_to_mlx_lm(packed, monkeypatch):
    args = _server_args(packed, "--expert-io", "mmap", "--max-tokens", "7")
    provider = StreamingModelProvider(args, load_options(args))
    model, tokenizer = provider.load("default_model")
    try:
        assert model.moeflux.stats_dict()["io_mode"] == "mmap"  # the streaming option reached it
        assert tokenizer.eos_token_ids and provider.is_batchable
        assert provider.model_key[0] == str(packed) and provider.processor is None
        assert provider.cli_args.max_tokens == 7  # mlx_lm.server's own flag
        assert provider.load("default_model")[0] is model  # loaded once
    finally:
        model.moeflux.close()
    assert has_routed_experts(packed)
    dense = []
    monkeypatch.setattr(mlx_server.ModelProvider, "_load", lambda self, *a: dense.append(a))
    monkeypatch.setattr(
        sys.modules[StreamingModelProvider.__module__], "has_routed_experts", lambda path: False
    )
    StreamingModelProvider(args, load_options(args))._load(str(packed))
    assert dense == [(str(packed), None, None)]  # a checkpoint without experts: mlx-lm's loader


def test_server_flags_cover_what_mlx_lm_server_reads():
    """Every ``cli_args.X`` that mlx_lm.server reads is a flag of ``moeflux-mlx server``, with
    mlx-lm's default; a newer mlx-lm that reads more fails here, not in a user's server."""
    read = set(re.findall(r"cli_args\.([a-z_]+)", Path(mlx_server.__file__).read_text()))
    args = _server_args("m")
    missing = sorted(read - set(vars(args)))
    assert not missing, f"flags mlx_lm.server reads but moeflux-mlx server lacks: {missing}"
    assert args.chat_template_args == {} and args.allowed_origins == ["*"]  # as mlx-lm parses them
    assert args.prompt_lookup == 0  # moeflux-mlx's own: prompt lookup off unless asked for
    args = _server_args("m", "--prompt-lookup", "3", "--ngram", "2")
    assert (args.prompt_lookup, args.ngram) == (3, 2)


# --------------------------------------------------------------------------- --prompt-lookup
TEXT = "the quick brown fox jumps over the lazy dog " * 3  # repeats: drafts get accepted


def test_lookup_stream_generate_is_stream_generate(packed):
    """What mlx_lm.server's ``_serve_single`` passes, with a ``PromptLookup`` as the draft model:
    the responses of plain ``stream_generate``, the cache left as it leaves it (prompt and every
    reply token: the server saves it under them), to the end and when stopped early."""
    model, tokenizer = moeflux_mlx.load(packed, backend="ops", cache_budget="25% experts")
    prompt = tokenizer.encode(TEXT)
    with model.moeflux:
        for stop_after in (None, 5):
            runs = []
            for draft in (None, PromptLookup(3)):
                cache, progress = make_prompt_cache(model), []
                responses = lookup_stream_generate(
                    model,
                    tokenizer,
                    prompt,
                    max_tokens=30,
                    draft_model=draft,
                    stream=generation_stream,
                    sampler=make_sampler(0.0),
                    logits_processors=[],
                    prompt_cache=cache,
                    num_draft_tokens=4,
                    input_embeddings=None,
                    prompt_progress_callback=lambda *a, out=progress: out.append(a),
                    prefill_step_size=32,
                    kv_bits=None,
                    kv_group_size=64,
                    quantized_kv_start=5000,
                )
                got = []
                for r in responses:
                    got.append((r.text, r.token, r.finish_reason, r.from_draft))
                    if len(got) == stop_after:
                        break
                responses.close()
                runs.append((got, cache[0].offset, progress))
            (plain, plain_offset, plain_progress), (got, offset, progress) = runs
            assert [g[:3] for g in got] == [g[:3] for g in plain]
            assert offset == plain_offset == len(prompt) + len(got)
            assert progress == plain_progress and progress[-1] == (len(prompt), len(prompt))
            if stop_after is None:
                assert any(g[3] for g in got)  # drafts were accepted


def test_lookup_stream_generate_falls_back_where_lookup_cannot_serve(packed, monkeypatch):
    calls = []
    monkeypatch.setattr(server_command, "mlx_stream_generate", lambda *a, **kw: calls.append(kw))
    lookup = PromptLookup(3)
    lookup_stream_generate("model", "tok", [1, 2], draft_model=lookup, prompt_cache=None)
    lookup_stream_generate("model", "tok", [], draft_model=lookup, prompt_cache=[])
    lookup_stream_generate("model", "tok", [1], draft_model=lookup, input_embeddings="images")
    assert len(calls) == 3 and all("draft_model" not in kw for kw in calls)
    lookup.prompt = [5, 6, 7, 8]
    assert lookup.context([7, 8]) == [5, 6] and lookup.context([9]) == []


def test_server_prompt_lookup_replies_as_without_it(packed, tmp_path):
    """Two servers side by side, one drafting by prompt lookup: the same greedy replies, to a
    first request and to a second turn that the prompt cache serves in part."""
    procs, bases = {}, {}
    for name, extra in (("plain", []), ("lookup", ["--prompt-lookup", "4", "--ngram", "3"])):
        port = _free_port()
        bases[name] = f"http://127.0.0.1:{port}"
        procs[name] = _start(packed, port, tmp_path / f"{name}.log", "--max-tokens", "24", *extra)
    replies = {}
    try:
        for name, proc in procs.items():
            _wait_ready(proc, bases[name])
        for name, base in bases.items():
            messages = [{"role": "user", "content": TEXT}]
            texts = []
            for _ in range(2):
                status, body = _post(
                    f"{base}/v1/chat/completions", {"temperature": 0, "messages": messages}
                )
                assert status == 200
                texts.append(json.loads(body)["choices"][0]["message"]["content"])
                messages += [
                    {"role": "assistant", "content": texts[-1]},
                    {"role": "user", "content": "again: " + TEXT},
                ]
            status, body = _post(
                f"{base}/v1/completions", {"temperature": 0, "prompt": TEXT, "max_tokens": 20}
            )
            texts.append(json.loads(body)["choices"][0]["text"])
            replies[name] = texts
    finally:
        for proc in procs.values():
            _stop(proc)
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
    assert replies["lookup"] == replies["plain"] and all(replies["plain"]), logs
    drafts = re.findall(
        r"prompt lookup: draft tokens: (\d+) proposed, (\d+) accepted", logs["lookup"]
    )
    assert len(drafts) == 3 and sum(int(a) for _, a in drafts) > 0, logs["lookup"]
    assert "prompt lookup" not in logs["plain"]
    assert all(proc.returncode == 0 for proc in procs.values()), logs


def test_server_prompt_lookup_provider(packed, monkeypatch):
    args = _server_args(packed, "--prompt-lookup", "2")
    provider = StreamingModelProvider(args, load_options(args))
    model, _ = provider.load("default_model")
    try:
        assert isinstance(provider.draft_model, PromptLookup) and not provider.is_batchable
    finally:
        model.moeflux.close()
    # a model whose KV cache cannot be trimmed (recurrent layers): refused in one line
    monkeypatch.setattr(server_command, "can_trim_prompt_cache", lambda cache: False)
    provider = StreamingModelProvider(args, load_options(args))
    with pytest.raises(server_command.UsageError, match="--prompt-lookup needs a KV cache"):
        provider.load("default_model")
    assert provider.model is None


def test_server_prompt_lookup_refusals(packed, capsys, monkeypatch):
    base = ["server", "--model", str(packed), "--port", "0", "--prompt-lookup", "2"]
    assert cli.main(base + ["--draft-model", str(packed)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt-lookup and --draft-model" in err, err
    monkeypatch.setattr(server_command, "distributed", lambda: object())  # as under mlx.launch
    assert cli.main(base) == 2
    err = capsys.readouterr().err
    assert "--prompt-lookup: not supported under mlx.launch" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        cli.main(base[:-1] + ["-1"])
    assert e.value.code == 2 and "--prompt-lookup" in capsys.readouterr().err
