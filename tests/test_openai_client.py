"""``moeflux-mlx server`` with a real client: the ``openai`` Python package, against a server on
127.0.0.1 (a free port) on a machine with no Hugging Face cache folder. Models, chat, streamed
chat, completions, refused requests, and a client that goes away mid-reply."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from moeflux_mlx.format.convert import convert
from tests.support import synth

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 90
REQUEST_TIMEOUT = 60
LIMIT = 1_000_000  # --max-tokens-limit: large, so that a reply can outlast its client


@contextlib.contextmanager
def serving(root: Path, args: list):
    """``(base_url, model_id, log_path, process)`` of ``moeflux-mlx server ARGS`` on a free port,
    with no Hugging Face cache folder at all (mlx-lm's /v1/models scan of it raises there);
    stopped at the end, which must leave no traceback and exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEFLUX_", "HF_"))}
    env.update(
        PYTHONPATH=str(REPO),
        HF_HOME=str(root / "no-hf-home"),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    log = root / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moeflux_mlx.cli", "server", "--port", "0", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while not (m := re.search(r"Serving (\S+) on (http://\S+/v1)", log.read_text())):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield m[2], m[1], log, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
    text = log.read_text()
    assert "Traceback" not in text, text
    assert proc.returncode == 0, text


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(base_url, model_id, log_path, process)`` of a running server; stopped at the end."""
    root = tmp_path_factory.mktemp("openai")
    src = synth.build_checkpoint(root / "qwen3_moe", "qwen3_moe", "tiny")
    packed = convert(src, root / "qwen3_moe-packed", progress=False)
    args = ["--model", str(packed), "--max-tokens", "8", "--max-tokens-limit", str(LIMIT)]
    with serving(root, args) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server[0], api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT
    )


def test_models_lists_the_served_model_without_a_hub_cache(server, client):
    base, model_id, _, _ = server
    assert not (Path(model_id).parent / "no-hf-home").exists()
    ids = [m.id for m in client.models.list()]
    assert ids == [model_id]
    model = client.models.retrieve(model_id)
    assert model.id == model_id and model.object == "model" and model.owned_by == "moeflux-mlx"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("gpt-4o")


def test_chat(server, client):
    reply = client.chat.completions.create(
        model=server[1],
        messages=[{"role": "user", "content": "Hello! How are you today?"}],
        max_tokens=6,
        temperature=0,
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert 1 <= reply.usage.completion_tokens <= 6
    # the default model, as clients that do not pick one send it
    reply = client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "Hi"}]
    )
    assert 1 <= reply.usage.completion_tokens <= 8  # the server's --max-tokens


def test_streamed_chat(server, client):
    stream = client.chat.completions.create(
        model=server[1],
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=6,
        stream=True,
    )
    chunks = list(stream)
    assert chunks and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_completions(server, client):
    reply = client.completions.create(model=server[1], prompt="Once upon a time", max_tokens=5)
    assert reply.object == "text_completion" and reply.choices[0].text
    assert 1 <= reply.usage.completion_tokens <= 5


def test_refused_requests(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server[1], messages=[{"role": "user", "content": "Hi"}], max_tokens=LIMIT + 1
        )
    assert e.value.status_code == 400
    assert f"is more than this server allows ({LIMIT}" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="temperature must be at least 0"):
        client.chat.completions.create(
            model=server[1], messages=[{"role": "user", "content": "Hi"}], temperature=-1
        )
    # the server is still well
    reply = client.completions.create(model=server[1], prompt="Hi", max_tokens=2)
    assert reply.choices[0].text is not None


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def test_generation_stops_when_the_client_goes_away(server, client):
    """A non-streamed request for many tokens, whose client hangs up after a second: the
    server stops generating (it goes idle) and says so in its log."""
    base, model_id, log, proc = server
    host, port = re.match(r"http://([^:/]+):(\d+)/", base).groups()
    body = json.dumps(
        {"model": model_id, "prompt": "Count to a million:", "max_tokens": LIMIT}
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        time.sleep(2.0)  # it is generating now
    deadline = time.monotonic() + 30
    while "the client went away" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    assert re.search(r"the client went away after \d+ tokens: generation stopped", log.read_text())
    server_process = psutil.Process(proc.pid)
    time.sleep(1.0)
    before = _cpu_seconds(server_process)
    time.sleep(3.0)
    busy = _cpu_seconds(server_process) - before
    assert busy < 1.0, f"the server used {busy:.2f} s of CPU in 3 s after its client left"
    reply = client.completions.create(model=model_id, prompt="Hi", max_tokens=2)
    assert reply.usage.completion_tokens <= 2
