"""``moeflux-mlx server`` against hostile requests, on the built-in demo model in a process of
its own: every bad request gets a 4xx that names what is wrong (OpenAI's error shape), the
process stays up, and a greedy request afterwards gets the same tokens as before. Also: a client
that leaves during its prefill frees the generation loop between two prefill steps, batched or
served alone, and ``--request-timeout`` ends a request that outlasts it."""

import http.client
import json
import re
import socket
import time

import psutil
import pytest

from moeflux_mlx.demo_model import checkpoint_path
from tests.test_server import _free_port, _start, _stop, _wait_ready

BODY_LIMIT = 65536
PREFILL_STEP = 64  # small, so that a long prompt takes several prefill steps
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 120)  # ~1800 tokens
GREEDY = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(port, log, process)`` of a server on the demo model; stopped (cleanly) at the end."""
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    port = _free_port()
    proc = _start(
        checkpoint_path(),
        port,
        log,
        "--max-tokens",
        "8",
        "--max-body-bytes",
        str(BODY_LIMIT),
        "--prefill-step-size",
        str(PREFILL_STEP),
    )
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}")
        yield port, log, proc
    finally:
        _stop(proc)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text


def request(port, method, path, body=b"", headers=None, timeout=60):
    """``(status, parsed JSON or raw bytes)`` of one request."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data


def raw(port, data: bytes, timeout=30) -> bytes:
    """What the server answers to ``data`` sent as is (up to its closing the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def greedy(port):
    status, reply = request(port, "POST", "/v1/completions", GREEDY)
    assert status == 200, reply
    return reply["choices"][0]["text"], reply["usage"]["completion_tokens"]


def chat(**fields):
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}


def text(**fields):
    return {"prompt": "Hello", "max_tokens": 4, **fields}


# (endpoint, body, expected status, the field the error must name or None)
BAD_FIELDS = [
    ("chat", chat(logit_bias={"999999": 1.0}), "logit_bias"),
    ("chat", chat(logit_bias={"4096": 1.0}), "logit_bias"),
    ("chat", chat(logit_bias={"-5": 1.0}), "logit_bias"),
    ("chat", chat(logit_bias={"abc": 1.0}), "logit_bias"),
    ("chat", chat(logit_bias={"5": 1000}), "logit_bias"),
    ("chat", chat(logit_bias={"5": "x"}), "logit_bias"),
    ("chat", chat(logit_bias=[1, 2]), "logit_bias"),
    ("chat", chat(logit_bias={str(i): 1 for i in range(2000)}), "logit_bias"),
    ("chat", chat(repetition_context_size=1_000_000_000_000), "repetition_context_size"),
    ("chat", chat(repetition_context_size=-1), "repetition_context_size"),
    ("chat", chat(presence_context_size=10**9), "presence_context_size"),
    ("chat", chat(frequency_context_size=10**9), "frequency_context_size"),
    ("chat", chat(repetition_penalty=-1), "repetition_penalty"),
    ("chat", chat(presence_penalty=5), "presence_penalty"),
    ("chat", chat(frequency_penalty="a"), "frequency_penalty"),
    ("chat", chat(top_logprobs=10**9, logprobs=True), "top_logprobs"),
    ("chat", chat(top_logprobs=-5), "top_logprobs"),
    ("chat", chat(logprobs="yes"), "logprobs"),
    ("chat", chat(top_k=10**9), "top_k"),
    ("chat", chat(top_k=-1), "top_k"),
    ("chat", chat(top_k=2.5), "top_k"),
    ("chat", chat(max_tokens=0), "max_tokens"),
    ("chat", chat(max_tokens=-1), "max_tokens"),
    ("chat", chat(max_tokens=10**12), "max_tokens"),
    ("chat", chat(max_tokens="5"), "max_tokens"),
    ("chat", chat(max_tokens=True), "max_tokens"),
    ("chat", chat(max_completion_tokens=10**9), "max_completion_tokens"),
    ("chat", chat(temperature=-1), "temperature"),
    ("chat", chat(temperature=3), "temperature"),
    ("chat", chat(temperature="hot"), "temperature"),
    ("chat", chat(top_p=2), "top_p"),
    ("chat", chat(min_p=-0.1), "min_p"),
    ("chat", chat(xtc_probability=2), "xtc_probability"),
    ("chat", chat(seed=-1), "seed"),
    ("chat", chat(seed=2**70), "seed"),
    ("chat", chat(seed=1.5), "seed"),
    ("chat", chat(num_draft_tokens=10**6), "num_draft_tokens"),
    ("chat", chat(stream="yes"), "stream"),
    ("chat", chat(stream=True, stream_options="x"), "stream_options"),
    ("chat", chat(n=1000), "n"),
    ("chat", chat(n=0), "n"),
    ("chat", chat(response_format={"type": "json_object"}), "response_format"),
    ("chat", chat(stop=["x"] * 100), "stop"),
    ("chat", chat(stop=[""]), "stop"),
    ("chat", chat(stop=5), "stop"),
    ("chat", chat(stop="x" * 10_000), "stop"),
    ("chat", chat(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs"),
    ("chat", chat(chat_template_kwargs=[]), "chat_template_kwargs"),
    ("chat", chat(tools="all"), "tools"),
    ("chat", chat(model=5), "model"),
    ("chat", chat(model="/etc"), "model"),
    ("chat", chat(model="../../../../tmp"), "model"),
    ("chat", chat(draft_model="/tmp"), "draft_model"),
    ("chat", chat(adapters="/tmp"), "adapters"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [1]}, "messages[0]"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, None),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        },
        None,
    ),
    ("chat", {"max_tokens": 4}, "messages"),
    ("text", {"max_tokens": 4}, "prompt"),
    ("text", text(prompt=[1, 2, 3]), "prompt"),
    ("text", text(prompt=["a", "b"]), "prompt"),
    ("text", text(prompt=5), "prompt"),
    ("text", text(prompt=None), "prompt"),
    ("text", text(echo=True), "echo"),
    ("text", text(best_of=3), "best_of"),
    ("text", text(prompt="word " * 10_000), "prompt"),
]


def test_bad_fields_are_refused_and_the_server_stays_well(server):
    port, log, proc = server
    before = greedy(port)
    for endpoint, body, param in BAD_FIELDS:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        status, reply = request(port, "POST", path, body)
        what = f"{json.dumps(body)[:120]} -> {status} {str(reply)[:300]}"
        assert 400 <= status < 500, what
        error = reply["error"]
        assert error["type"] == "invalid_request_error" and error["message"], what
        assert "Traceback" not in error["message"] and "object has no" not in error["message"]
        if param is not None:
            assert error["param"] == param, what
        assert proc.poll() is None, what
    # the prompt that is too long is refused with both counts
    status, reply = request(port, "POST", "/v1/completions", text(prompt="word " * 10_000))
    assert re.search(r"is 10001 tokens, more than this server accepts \(2048", str(reply)), reply
    assert greedy(port) == before


def test_valid_edges_are_served(server):
    port, _, _ = server
    for endpoint, body in [
        ("chat", chat(n=1, logit_bias={"0": -100, "4095": 100.0})),
        ("chat", chat(stream=True, stream_options={})),
        ("chat", chat(top_k=4095, top_p=1, min_p=0, temperature=2)),
        ("chat", chat(seed=2**64 - 1, temperature=1)),
        ("chat", chat(repetition_penalty=1.2, repetition_context_size=2048)),
        ("chat", chat(top_logprobs=11, logprobs=True)),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        ("text", text(prompt=["Hello"], stop=["\n", "."], response_format={"type": "text"})),
    ]:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        status, reply = request(port, "POST", path, body)
        assert status == 200, (body, reply)


def test_bad_http_is_refused(server):
    port, _, proc = server
    before = greedy(port)
    post = "/v1/completions"
    cases = [
        (request(port, "POST", post, b"{"), 400),
        (request(port, "POST", post, b"[]"), 400),
        (request(port, "POST", post, b"null"), 400),
        (request(port, "POST", post, b"[" * 30_000 + b"]" * 30_000), 400),
        (request(port, "POST", post, b'{"prompt": "a", "temperature": Infinity}'), 400),
        (request(port, "POST", post, b'{"prompt": "\xff\xfe"}'), 400),
        (request(port, "POST", post, b"x" * (BODY_LIMIT + 1)), 413),
        (request(port, "POST", post, b"{}", {"Content-Type": "text/html"}), 415),
        (request(port, "POST", post, b"prompt=hi", {"Content-Type": "multipart/form-data"}), 415),
        (request(port, "POST", "/v1/embeddings", {"input": "x"}), 404),
        (request(port, "POST", "/v1/completions/../../admin", {"prompt": "x"}), 404),
        (request(port, "GET", "/admin"), 404),
        (request(port, "GET", "/v1/models/nope"), 404),
        (request(port, "PUT", post, b"{}"), 501),
        (request(port, "DELETE", "/v1/models"), 501),
    ]
    for (status, reply), expected in cases:
        assert status == expected, reply
        if expected != 501:
            assert reply["error"]["message"], reply
    head = f"POST {post} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for data, expected in [
        ((head + "\r\n").encode(), b" 411 "),  # no Content-Length
        ((head + "Transfer-Encoding: chunked\r\n\r\n3\r\n{}\n\r\n0\r\n\r\n").encode(), b" 411 "),
        ((head + "Content-Length: -5\r\n\r\n").encode(), b" 400 "),
        ((head + "Content-Length: 1e9\r\n\r\n").encode(), b" 400 "),
        ((head + f"Content-Length: {10**12}\r\n\r\n").encode(), b" 413 "),
        ((head + "X-Big: " + "a" * 70_000 + "\r\n\r\n").encode(), b" 4"),  # header too long
        ((head + "".join(f"X-{i}: a\r\n" for i in range(200)) + "\r\n").encode(), b" 431 "),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", b" 414 "),
        (b"\x16\x03\x01 garbage\r\n\r\n", b" 400 "),  # not HTTP
    ]:
        answer = raw(port, data)
        # (a request line that is not HTTP is answered as HTTP/0.9: no status line)
        code = b"Error code: " + expected.strip()
        assert expected in answer[:20] or code in answer, (data[:60], answer[:200])
    # a body cut short by a client that leaves, and a client that says nothing
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall((head + 'Content-Length: 1000\r\n\r\n{"prompt": ').encode())
    with socket.create_connection(("127.0.0.1", port)):
        pass
    assert proc.poll() is None
    assert greedy(port) == before


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _abandon_during_prefill(port, log, body, marker):
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    seen = log.read_text().count(marker)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + data)
        deadline = time.monotonic() + 30  # until its prefill has begun
        while "Prompt processing progress: " + str(PREFILL_STEP) not in log.read_text()[-4000:]:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
    deadline = time.monotonic() + 30
    while log.read_text().count(marker) == seen:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.parametrize("served", ["batched", "alone"])
def test_a_client_that_leaves_during_its_prefill_frees_the_loop(server, served):
    """A prompt of ~1800 tokens prefilled 64 at a time; its client leaves after the first
    step: the prefill stops at the next step, and the server goes idle."""
    port, log, proc = server
    before = greedy(port)
    body = {"prompt": LONG_PROMPT, "max_tokens": 4}
    if served == "alone":
        body["seed"] = 7  # a seeded request is served alone (mlx-lm's _serve_single)
    _abandon_during_prefill(port, log, body, "went away during its prefill")
    text = log.read_text()
    progress = [int(m) for m in re.findall(r"Prompt processing progress: (\d+)/\d+", text)]
    assert progress and max(progress) < 1700, "the prefill ran to its end"
    # idle again within a few prefill steps (a step of 64 tokens takes up to a second or so on
    # a 2-core machine; the whole prefill, tens of seconds)
    server_process = psutil.Process(proc.pid)
    deadline = time.monotonic() + 12
    while True:
        start = _cpu_seconds(server_process)
        time.sleep(0.5)
        if _cpu_seconds(server_process) - start < 0.15:
            break
        assert time.monotonic() < deadline, "the server is still busy after its client left"
    assert greedy(port) == before


def test_request_timeout(tmp_path):
    """--request-timeout: a reply that outlasts it ends with finish_reason "length" (what was
    generated so far); one still in its prefill is answered 408; the server stays well."""
    port = _free_port()
    log = tmp_path / "server.log"
    proc = _start(
        checkpoint_path(),
        port,
        log,
        "--request-timeout",
        "3",
        "--prefill-step-size",
        "16",
        "--max-tokens-limit",
        "2048",
    )
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}")
        start = time.monotonic()
        status, reply = request(port, "POST", "/v1/completions", text(max_tokens=2000))
        assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply
        assert reply["usage"]["completion_tokens"] < 2000
        assert time.monotonic() - start < 15
        status, reply = request(port, "POST", "/v1/completions", text(prompt=LONG_PROMPT, seed=1))
        assert status == 408 and reply["error"]["code"] == "request_timeout", reply
        status, _ = request(port, "POST", "/v1/completions", text(max_tokens=2))
        assert status == 200
    finally:
        _stop(proc)
    assert proc.returncode == 0, log.read_text()
    assert "--request-timeout passed" in log.read_text()
