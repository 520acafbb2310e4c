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

from moeflux_mlx import cli
from moeflux_mlx.commands.common import load_options
from moeflux_mlx.commands.server import StreamingModelProvider, has_routed_experts
from moeflux_mlx.format.convert import convert
from moeflux_mlx.testing import synth

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
