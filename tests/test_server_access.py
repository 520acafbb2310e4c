"""``moeflux-mlx server --api-key-file/--allowed-models`` with a real client (the ``openai``
package): without the key every endpoint answers 401; with it, requests are served; a request's
``model`` loads only what ``--allowed-models`` lists (or the served model)."""

import re
import urllib.error
import urllib.request

import pytest

from moeflux_mlx.commands.common import UsageError
from moeflux_mlx.commands.server import resolve_api_key
from moeflux_mlx.demo_model import checkpoint_path
from tests.test_openai_client import serving

openai = pytest.importorskip("openai")

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(base_url, alias, log, process)``: the demo model served with a key from a file, and
    ``alias`` (a link to the demo checkpoint) allowed besides it."""
    root = tmp_path_factory.mktemp("access")
    (root / "key").write_text(KEY + "\n")
    alias = root / "alias"
    alias.symlink_to(checkpoint_path(), target_is_directory=True)
    args = ["--api-key-file", str(root / "key"), "--allowed-models", str(alias)]
    with serving(root, args + ["--max-tokens", "4"]) as (url, _, log, proc):
        yield url, str(alias), log, proc
    text = log.read_text()
    assert KEY not in text  # the key is never logged


def _health(base, key):
    url = base.rsplit("/v1", 1)[0] + "/health"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _client(base, key):
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)


def test_every_endpoint_needs_the_key(server):
    base = server[0]
    hi = [{"role": "user", "content": "Hi"}]
    for key in ("wrong", KEY[:-1], KEY + "x", ""):
        client = _client(base, key or "-")
        with pytest.raises(openai.AuthenticationError) as e:
            client.chat.completions.create(model="default_model", messages=hi)
        assert e.value.status_code == 401 and "Authorization: Bearer" in str(e.value)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="default_model", prompt="Hi")
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        assert _health(base, key) == 401
    client = _client(base, KEY)
    reply = client.chat.completions.create(model="default_model", messages=hi, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 4
    assert client.models.list().data
    assert _health(base, KEY) == 200


def test_only_allowed_models_are_loaded(server):
    base, alias, log, _ = server
    client = _client(base, KEY)
    hi = [{"role": "user", "content": "Hi"}]
    for name in ("/etc", "/tmp", "gpt-4o", "Qwen/Qwen3-30B-A3B", alias + "/.."):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=name, messages=hi)
        assert "is not served here" in str(e.value)
        assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    assert not re.search(r"loading (/etc|/tmp |gpt|Qwen)", log.read_text())  # nothing loaded
    reply = client.completions.create(model=alias, prompt="Once upon a time", temperature=0)
    first = reply.choices[0].text
    assert first
    reply = client.completions.create(model="default_model", prompt="Once upon a time")
    assert reply.choices[0].text == first  # the same weights, loaded back
    assert alias in {m.id for m in client.models.list()}


def test_api_key_sources(tmp_path, monkeypatch):
    import argparse

    def args(**kw):
        return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})

    monkeypatch.delenv("MOEFLUX_API_KEY", raising=False)
    assert resolve_api_key(args()) is None
    monkeypatch.setenv("MOEFLUX_API_KEY", " env-key ")
    assert resolve_api_key(args()) == "env-key"
    assert resolve_api_key(args(api_key="flag")) == "flag"
    (tmp_path / "k").write_text("file-key\n")
    assert resolve_api_key(args(api_key_file=str(tmp_path / "k"))) == "file-key"
    for bad in (
        args(api_key="a", api_key_file=str(tmp_path / "k")),
        args(api_key_file=str(tmp_path / "missing")),
        args(api_key="two words"),
        args(api_key=" "),
    ):
        with pytest.raises(UsageError):
            resolve_api_key(bad)
