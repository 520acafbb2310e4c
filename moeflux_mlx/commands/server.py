"""``moeflux-mlx server``: mlx-lm's OpenAI-compatible HTTP server on a streaming model.

Nothing here serves HTTP. mlx-lm's server takes its models from a ``ModelProvider`` given to
``mlx_lm.server.run``; ``StreamingModelProvider`` is one whose checkpoints with routed experts are
loaded by ``moeflux_mlx.load``. Everything else (routes, batching, prompt cache, sampling
defaults) is mlx-lm's own. A checkpoint without routed experts (e.g. a dense ``--draft-model``)
still goes to mlx-lm's loader.

The command declares mlx_lm.server's own flags (``MLX_SERVER_FLAGS``), with its defaults, so that
``--help`` shows them and the provider gets the arguments mlx-lm's server reads;
``tests/test_server.py`` checks them against the attributes mlx-lm's server reads.

Before it listens, the command takes its port (in use: one line, exit 2) and loads the model in
full, as ``generate`` does (a damaged model: one line, exit 2, never a server whose generation
thread died). Its request handler (``StreamingAPIHandler``, a subclass of mlx-lm's) adds three
things: ``max_tokens`` above ``--max-tokens-limit`` (default: the model's context length) is
refused with 400; generation stops when the client goes away (mlx-lm stops a streamed reply
when a write fails; a non-streamed reply writes nothing until the end, so the handler watches
the connection between tokens); ``GET /v1/models`` lists the served model even where no Hugging
Face cache folder exists (mlx-lm's scan of that cache raises there), and ``GET /v1/models/ID``
returns one model.

With ``--prompt-lookup K`` the provider's draft model is a ``PromptLookup``, which holds no
weights: being a draft model, it makes mlx-lm serve each request alone (not batched) through
``stream_generate``, and ``serve`` makes mlx_lm.server's ``stream_generate`` one that sends such
requests to ``stream_lookup_generate`` (``lookup_stream_generate``). Greedy replies are the
tokens of decoding without it.
"""

from __future__ import annotations

import argparse
import errno
import gc
import ipaddress
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import urllib.parse
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, List, Optional

import mlx.core as mx
import mlx_lm
import mlx_lm.server as mlx_server
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.utils import load_config, maybe_set_recommended_wired_limit

from ..errors import CheckpointError, MoefluxError
from ..format.checkpoint import EXPERT_KEY, is_packed, read_config
from ..format.safetensors import index_directory
from ..io.store import open_store
from ..model.load import load
from ..model.lookup_decoding import (
    DEFAULT_NUM_DRAFT_TOKENS,
    LookupStats,
    stream_lookup_generate,
)
from ..model.sharded import sharded_load
from ..options import LoadOptions
from .common import (
    UsageError,
    add_load_args,
    add_lookup_args,
    add_model_arg,
    command_parser,
    distributed,
    int_at_least,
    load_options,
    main_for,
    positive_int,
    resolve_model,
    say,
)

log = logging.getLogger(__name__)

DESCRIPTION = "serve a streaming model through mlx-lm's OpenAI-compatible HTTP server"
EPILOG = """\
The options after the streaming ones are mlx_lm.server's, with its defaults.

Endpoints (mlx-lm): POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health.
A request for more than --max-tokens-limit tokens is refused (400). Generation stops when the
client disconnects. With --prompt-lookup K requests are served one at a time (not batched), each
drafting up to K tokens (a request's num_draft_tokens overrides K).
"""


def _kv_cache_bytes(text: str) -> int:
    """``--prompt-cache-bytes`` as mlx-lm parses it, a bad value a usage error (mlx-lm's parser
    raises decimal or key errors, which argparse would show as a traceback)."""
    try:
        return mlx_server._parse_size(text)
    except Exception:  # noqa: BLE001 - InvalidOperation, KeyError, ValueError ...
        raise argparse.ArgumentTypeError(
            f"expected a size such as 8GB or 512MB, got {text!r}"
        ) from None


# mlx_lm.server's flags (version 0.32), as its own ``main`` declares them: (flag, keywords).
MLX_SERVER_FLAGS = (
    ("--adapter-path", dict(type=str, help="trained adapter weights (not with streamed experts)")),
    (
        "--allowed-origins",
        dict(type=lambda x: x.split(","), default="*", help="allowed origins (default: *)"),
    ),
    ("--draft-model", dict(type=str, default=None, help="a model for speculative decoding")),
    (
        "--num-draft-tokens",
        dict(type=int_at_least(0), default=3, help="tokens to draft (default: 3)"),
    ),
    ("--trust-remote-code", dict(action="store_true", help="trust remote code for the tokenizer")),
    (
        "--log-level",
        dict(
            type=str,
            default="INFO",
            choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
            help="logging level (default: INFO)",
        ),
    ),
    ("--chat-template", dict(type=str, default="", help="a chat template for the tokenizer")),
    ("--use-default-chat-template", dict(action="store_true", help="the default chat template")),
    ("--temp", dict(type=float, default=0.0, help="default sampling temperature (default: 0.0)")),
    ("--top-p", dict(type=float, default=1.0, help="default nucleus top-p (default: 1.0)")),
    ("--top-k", dict(type=int_at_least(0), default=0, help="default top-k (default: 0, off)")),
    ("--min-p", dict(type=float, default=0.0, help="default min-p (default: 0.0, off)")),
    (
        "--max-tokens",
        dict(
            type=positive_int,
            default=512,
            help="maximum tokens of a request that does not say (default: 512)",
        ),
    ),
    (
        "--chat-template-args",
        dict(type=json.loads, default="{}", help="JSON arguments for apply_chat_template"),
    ),
    ("--decode-concurrency", dict(type=positive_int, default=32, help="batched decode requests")),
    ("--prompt-concurrency", dict(type=positive_int, default=8, help="batched prompts")),
    (
        "--prefill-step-size",
        dict(type=positive_int, default=2048, help="prefill step (default: 2048)"),
    ),
    ("--prompt-cache-size", dict(type=int_at_least(0), default=10, help="distinct KV caches kept")),
    (
        "--prompt-cache-bytes",
        dict(type=_kv_cache_bytes, help="maximum size in bytes of the KV caches (e.g. 8GB)"),
    ),
    ("--kv-bits", dict(type=int, default=None, help="KV cache quantization bits (off)")),
    (
        "--kv-group-size",
        dict(type=positive_int, default=64, help="KV cache quantization group size"),
    ),
    (
        "--quantized-kv-start",
        dict(
            type=int,
            default=mlx_server.DEFAULT_QUANTIZED_KV_START,
            help="token position where KV cache quantization starts",
        ),
    ),
    (
        "--pipeline",
        dict(
            action="store_true",
            help="under mlx.launch: a pipeline (each process a range of layers) instead of "
            "tensor parallelism; each process reads only its share of the experts",
        ),
    ),
)


def has_routed_experts(path: Path) -> bool:
    """Headers only: a converted directory, or safetensors with stacked routed experts (the
    projections of a SwitchGLU / SwitchMLP, stacked over experts, whatever the module's name)."""
    from ..format.checkpoint import find_stacked_experts

    path = Path(path)
    if is_packed(path):
        return True
    shapes = {n: r.shape for n, r in index_directory(path).items() if EXPERT_KEY.match(n)}
    return bool(find_stacked_experts(shapes))


class PromptLookup:
    """Prompt-lookup drafting, kept where mlx-lm's server keeps a draft model
    (``ModelProvider.draft_model``); it holds no weights and no cache.

    A draft model makes mlx-lm serve each request alone through ``stream_generate``, which
    ``lookup_stream_generate`` sends to ``stream_lookup_generate`` for this one. ``prompt`` is the
    whole prompt of the request being served (``StreamingResponseGenerator`` sets it), since
    ``stream_generate`` gets only the part the prompt cache lacks and drafts come from all of it.
    """

    def __init__(self, ngram_max: int):
        self.ngram_max = ngram_max
        self.prompt: List[int] = []

    def make_cache(self) -> list:
        """Returns: ``[]``: mlx-lm appends a draft model's cache to the model's; none here."""
        return []

    def context(self, rest: List[int]) -> List[int]:
        """The tokens of ``prompt`` before ``rest``, searched for drafts (not fed to the model).

        Args:
            rest: What ``stream_generate`` was given: the tail of ``prompt`` not in the cache.

        Returns:
            The rest of ``prompt`` (what the cache holds), or ``[]`` where ``rest`` is not its
            tail.
        """
        n = len(self.prompt) - len(rest)
        return list(self.prompt[:n]) if n >= 0 and list(self.prompt[n:]) == list(rest) else []


# what lookup_generate_step takes of what mlx_lm.server passes to stream_generate
_LOOKUP_KEYWORDS = {
    "sampler",
    "logits_processors",
    "prompt_cache",
    "prefill_step_size",
    "kv_bits",
    "kv_group_size",
    "quantized_kv_start",
    "prompt_progress_callback",
    "stream",
}


def lookup_stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
    """mlx-lm's ``stream_generate``, as mlx_lm.server calls it, with prompt-lookup speculation
    where the draft model is a ``PromptLookup``.

    Such a request falls back to plain decoding (without the draft) where lookup cannot serve
    it: image embeddings, an empty prompt (mlx-lm's own error then), a cache that cannot be
    trimmed (a full rotating cache), or a keyword a newer mlx-lm passes that lookup lacks.

    Args:
        model: The served model.
        tokenizer: Its tokenizer.
        prompt: The prompt's tokens not yet in ``kwargs["prompt_cache"]``.
        max_tokens: The most tokens to generate.
        draft_model: mlx-lm's draft model, a ``PromptLookup``, or None.
        **kwargs: The rest of what mlx_lm.server passes (``num_draft_tokens``, ``sampler``,
            ``prompt_cache``, ...).

    Returns:
        A generator of mlx-lm ``GenerationResponse``s; after a lookup reply (ended or closed),
        the prompt cache holds the prompt and every token of the reply, as after
        ``stream_generate``, which is what mlx_lm.server saves it under.
    """
    if not isinstance(draft_model, PromptLookup):
        return mlx_stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, draft_model=draft_model, **kwargs
        )
    num_draft_tokens = kwargs.pop("num_draft_tokens", None)
    if num_draft_tokens is None:
        num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS
    cache = kwargs.get("prompt_cache")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _LOOKUP_KEYWORDS)
    if unknown or len(prompt) == 0 or cache is None or not can_trim_prompt_cache(cache):
        if unknown:  # input_embeddings (images), or what a newer mlx-lm passes
            log.info("prompt lookup not used for this request (it takes no %s)", ", ".join(unknown))
        return mlx_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs)
    stats = LookupStats()
    responses = stream_lookup_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        num_draft_tokens=num_draft_tokens,
        ngram_max=draft_model.ngram_max,
        context=draft_model.context(list(prompt)),
        stats=stats,
        cache_last_token=True,
        **{k: v for k, v in kwargs.items() if k in _LOOKUP_KEYWORDS},
    )
    return _logged(responses, stats)


def _logged(responses, stats: LookupStats):
    """``responses``, then one log line of the request's drafts (also when stopped early)."""
    try:
        yield from responses
    finally:
        responses.close()
        log.info("prompt lookup: %s", stats.summary())


class StreamingModelProvider(mlx_server.ModelProvider):
    """mlx-lm's ``ModelProvider``, loading checkpoints with routed experts through
    ``moeflux_mlx.load`` with ``options``; other checkpoints as mlx-lm does. With
    ``--prompt-lookup`` (``cli_args.prompt_lookup``), a model loaded without a draft model gets a
    ``PromptLookup`` as its draft model."""

    def __init__(self, cli_args: argparse.Namespace, options: LoadOptions):
        super().__init__(cli_args)
        self.options = options

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        self._load_checkpoint(model_path, adapter_path, draft_model_path)
        if getattr(self.cli_args, "prompt_lookup", 0) and self.draft_model is None:
            cache = make_prompt_cache(self.model)
            if not can_trim_prompt_cache(cache):
                kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
                self.reset()
                raise UsageError(
                    f"{model_path}: --prompt-lookup needs a KV cache that can be trimmed; this "
                    f"model's has {', '.join(kinds)} layers"
                )
            self.draft_model = PromptLookup(self.cli_args.ngram)
            self.is_batchable = False  # as with any draft model: each request served alone

    def _load_checkpoint(self, model_path, adapter_path=None, draft_model_path=None):
        path = resolve_model(str(model_path))
        if not has_routed_experts(path):
            log.warning("%s has no routed experts: loading it with mlx_lm.load", path)
            return super()._load(str(path), adapter_path, draft_model_path)
        if adapter_path is not None:
            raise CheckpointError(
                f"{adapter_path}: adapters are not supported with streamed experts"
            )
        # as mlx-lm's provider does: the old model's buffers go back before the new one loads
        self.reset()
        gc.collect()
        mx.clear_cache()
        if self.is_distributed:  # the groups mlx-lm's provider chose from --pipeline
            log.info("loading this process's share of %s (experts stream from disk)", path)
            model, tokenizer = sharded_load(
                path,
                self.pipeline_group,
                self.tensor_group,
                tokenizer_config=self._tokenizer_config,
                options=self.options,
            )
        else:
            log.info("loading %s with moeflux_mlx.load (experts stream from disk)", path)
            model, tokenizer = load(
                path, tokenizer_config=self._tokenizer_config, options=self.options
            )
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        draft_model = None
        if draft_model_path is not None:
            draft_model, draft_tokenizer = mlx_lm.load(str(draft_model_path))
            if draft_tokenizer.vocab_size != tokenizer.vocab_size:
                log.warning("the draft model's tokenizer does not match the model's")
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.processor = load_processor(model, load_config(path))
        self.is_batchable = draft_model is None and all(
            hasattr(c, "merge") for c in make_prompt_cache(model)
        )


class StreamingResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's ``ResponseGenerator``; with prompt lookup, it gives the ``PromptLookup`` each
    request's whole prompt (``stream_generate`` gets only the part the prompt cache lacks)."""

    def _tokenize(self, tokenizer, request, args):
        out = super()._tokenize(tokenizer, request, args)
        draft = self.model_provider.draft_model
        if isinstance(draft, PromptLookup):
            draft.prompt = list(out[0])
        return out


class ClientGone(ConnectionAbortedError):
    """The client closed its connection while its reply was being generated."""


def client_gone(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` closed the connection (readable, and nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed
        return True


class _WatchedResponses:
    """mlx-lm's ``ResponseGenerator`` as one request's handler sees it: its token stream stops
    (and generation with it: ``ctx.stop()``) as soon as the client has gone away. mlx-lm notices
    that itself only when a write fails, and a non-streamed reply writes nothing until the end."""

    def __init__(self, inner: Any, handler: mlx_server.APIHandler):
        self._inner, self._handler = inner, handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, request, args, progress_callback=None):
        ctx, responses = self._inner.generate(request, args, progress_callback=progress_callback)
        return ctx, self._watch(ctx, responses)

    def _watch(self, ctx, responses):
        n = 0
        for response in responses:
            yield response
            n += 1
            if client_gone(self._handler.connection):
                ctx.stop()
                raise ClientGone(f"the client went away after {n} tokens: generation stopped")


class _OpenAIErrors:
    """The handler's output, with mlx-lm's error bodies (``{"error": "text"}``) in OpenAI's
    shape (``{"error": {"message": "text", ...}}``), the one clients read the message from (the
    ``openai`` package shows only "Error code: 400" otherwise). Everything else passes as is."""

    def __init__(self, out: Any, handler: StreamingAPIHandler):
        self._out, self._handler = out, handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)

    def write(self, data) -> int:
        status = getattr(self._handler, "_status", 200)
        if status >= 400 and bytes(data[:10]).startswith(b'{"error":'):
            try:
                body = json.loads(bytes(data))
            except ValueError:
                body = None
            if isinstance(body, dict) and isinstance(body.get("error"), str):
                kind = "invalid_request_error" if status < 500 else "server_error"
                error = {"message": body["error"], "type": kind, "param": None, "code": None}
                data = json.dumps({"error": error}).encode()
        return self._out.write(data)


class StreamingAPIHandler(mlx_server.APIHandler):
    """mlx-lm's request handler with a ``max_tokens`` cap, generation stopped when the client
    disconnects, and a ``/v1/models`` that always lists the served model.

    ``serve`` makes a subclass that sets ``served_model`` (the id the model is listed under: its
    resolved path, as mlx-lm names it) and ``max_tokens_limit`` (None: no cap)."""

    served_model: str = ""
    max_tokens_limit: Optional[int] = None

    def __init__(self, response_generator, *args, **kwargs):
        self._status = 200
        super().__init__(_WatchedResponses(response_generator, self), *args, **kwargs)

    def setup(self) -> None:
        super().setup()
        self.wfile = _OpenAIErrors(self.wfile, self)

    def send_response(self, code, message=None) -> None:
        self._status = code
        super().send_response(code, message)

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        limit = self.max_tokens_limit
        if limit is not None and self.max_tokens > limit:
            raise ValueError(
                f"max_tokens {self.max_tokens} is more than this server allows ({limit}, "
                "its --max-tokens-limit: by default the model's context length)"
            )

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _model(self, model_id: str, owner: str) -> dict:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": owner}

    def _cached_models(self) -> list:
        """Models in the Hugging Face cache, as mlx-lm lists them; none when there is no cache."""
        try:
            repos = mlx_server.scan_cache_dir().repos
        except Exception as e:  # noqa: BLE001 - no cache folder (CacheNotFound), unreadable ...
            log.debug("no Hugging Face cache to list models from (%s)", e)
            return []
        need = {"config.json", "model.safetensors.index.json", "tokenizer_config.json"}
        out = []
        for repo in repos:
            try:
                names = {f.file_path.name for f in repo.refs["main"].files}
            except (KeyError, AttributeError):
                continue
            if repo.repo_type == "model" and need <= names:
                out.append(self._model(repo.repo_id, "huggingface"))
        return out

    def handle_models_request(self) -> None:
        models = [self._model(self.served_model, "moeflux-mlx")]
        models += [m for m in self._cached_models() if m["id"] != self.served_model]
        path = urllib.parse.unquote(self.path.split("?", 1)[0])
        wanted = path[len("/v1/models/") :] if path.startswith("/v1/models/") else ""
        if not wanted:
            self._send_json(200, {"object": "list", "data": models})
            return
        found = [m for m in models if m["id"] == wanted or wanted == "default_model"]
        if found:
            self._send_json(200, found[0])
        else:
            self._send_json(
                404,
                {
                    "error": {
                        "message": f"model {wanted!r} is not served here; GET /v1/models lists "
                        "what is",
                        "type": "invalid_request_error",
                        "code": "model_not_found",
                    }
                },
            )


class StreamingHTTPServer(ThreadingHTTPServer):
    """mlx-lm's server class, made to say a dropped connection in one log line rather than a
    traceback."""

    daemon_threads = True  # a request still being answered does not hold the process at exit

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):  # ClientGone, BrokenPipeError, reset
            log.info("%s: %s", client_address[0], error)
            return
        super().handle_error(request, client_address)


def context_length(config: dict) -> Optional[int]:
    """The model's context length (``max_position_embeddings``), None when config.json lacks it."""
    for section in (config.get("text_config") or {}, config):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def listen(host: str, port: int, handler_class, responses_for) -> StreamingHTTPServer:
    """Take ``host:port`` now, before anything slow: a port in use is one line and exit 2.

    Args:
        host, port: where to listen (port 0: any free port).
        handler_class: the request handler class.
        responses_for: returns the ``ResponseGenerator``; called per request, so the server can
            be bound before that exists (nothing is accepted before ``serve_forever``).

    Raises:
        UsageError: the host does not resolve, the port is in use or not allowed.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: not an address to listen on ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    server_class = type("Server", (StreamingHTTPServer,), {"address_family": family})
    fingerprint = mlx_server.get_system_fingerprint()

    def handler(*a, **kw):
        return handler_class(responses_for(), *a, system_fingerprint=fingerprint, **kw)

    try:
        return server_class(address, handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = "is already in use (another server?); choose another with --port"
        elif e.errno == errno.EACCES:
            why = "is not allowed (ports below 1024 need privileges); choose another with --port"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = f"cannot be listened on: {host} is not an address of this machine"
        else:
            why = f"cannot be listened on ({e.strerror or e})"
        raise UsageError(f"{host}:{port} {why}") from None


def _stop(signum, frame):
    raise KeyboardInterrupt  # serve() shuts down cleanly on it


def serve(
    args: argparse.Namespace,
    options: LoadOptions,
    max_tokens_limit: Optional[int] = None,
    rank: int = 0,
) -> None:
    """Run mlx-lm's server on ``args`` (mlx_lm.server's arguments) with experts streamed by
    ``options``; blocks until Ctrl-C or SIGTERM.

    The port is taken first and the model loaded in full before a request is accepted, so a port
    in use or a damaged model is one line (``UsageError``, ``MoefluxError``), never a server that
    listens with a dead generation thread. Under mlx.launch only rank 0 listens; the other
    processes load their share and generate with it, as in mlx-lm's server (``rank`` > 0).
    """
    signal.signal(signal.SIGTERM, _stop)
    if rank > 0:
        _serve_share(args, options)
        return
    handler_class = type(
        "Handler",
        (StreamingAPIHandler,),
        {"served_model": str(Path(args.model).resolve()), "max_tokens_limit": max_tokens_limit},
    )
    holder: dict = {}
    httpd = listen(args.host, args.port, handler_class, lambda: holder["responses"])
    if not ipaddress.ip_address(httpd.server_address[0]).is_loopback:
        log.warning(
            "listening on %s, beyond this machine: mlx_lm.server is not recommended for "
            "production, as it only implements basic security checks",
            args.host,
        )
    provider = StreamingModelProvider(args, options)
    plain_stream_generate = mlx_server.stream_generate
    try:
        maybe_set_recommended_wired_limit()
        _load_now(provider, args)
        # mlx_lm.server calls stream_generate for requests it serves alone: this one sends those
        # whose draft model is a PromptLookup to prompt lookup, the rest to mlx-lm's own
        mlx_server.stream_generate = lookup_stream_generate
        host, port = httpd.server_address[:2]
        say(
            f"Serving {args.model} on http://{host}:{port}/v1 (mlx-lm server, experts streamed; "
            f"max_tokens up to {max_tokens_limit or 'any'}; Ctrl-C stops)"
        )
        prompt_cache = mlx_server.LRUPromptCache(args.prompt_cache_size)
        holder["responses"] = responses = StreamingResponseGenerator(provider, prompt_cache)
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            log.info("stopping")
        finally:
            # serve_forever has returned: stop the generation thread, then the connections
            responses.stop_and_join()
            _wait_for_native_exit(getattr(responses, "_generation_thread", None))
    finally:
        mlx_server.stream_generate = plain_stream_generate
        httpd.server_close()
        model = provider.model
        if model is not None and hasattr(model, "moeflux"):
            model.moeflux.close()


class _PeerGone(logging.Filter):
    """Drops mlx-lm's report that the generation thread died because rank 0 went away."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "connection to a peer was lost" not in record.getMessage()


def _expect_peer_gone() -> None:
    """Rank 0 stopping ends this process's generation loop with a lost connection: expected,
    so neither mlx-lm's report of it nor the ring backend's (written by MLX's C++ code to file
    descriptor 2) is shown. Python's own messages (``sys.stderr``, logging) still are."""
    logging.getLogger().addFilter(_PeerGone())
    stream = sys.stderr
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
            handler.setStream(sys.stderr)


def _serve_share(args: argparse.Namespace, options: LoadOptions) -> None:
    """A process of rank > 0 under mlx.launch: its share of the model, and mlx-lm's generation
    loop, which takes each request from rank 0 (``mlx_lm.server.run`` on such a rank)."""
    provider = StreamingModelProvider(args, options)
    try:
        _load_now(provider, args)
        _expect_peer_gone()
        prompt_cache = mlx_server.LRUPromptCache(args.prompt_cache_size)
        responses = mlx_server.ResponseGenerator(provider, prompt_cache)
        try:
            responses.join()
        except KeyboardInterrupt:
            responses.stop_and_join()
        _wait_for_native_exit(getattr(responses, "_generation_thread", None))
    finally:
        model = provider.model
        if model is not None and hasattr(model, "moeflux"):
            model.moeflux.close()


def _wait_for_native_exit(thread: Optional[threading.Thread], timeout_s: float = 5.0) -> None:
    """Wait until ``thread`` is gone from the OS too, not only from Python (``join``).

    When a thread that ran compiled MLX functions ends, MLX's thread-local compile cache is
    destroyed after Python's ``join`` has returned, and it takes the GIL to release the Python
    objects it holds. If the interpreter is being finalized by then, taking the GIL ends the
    thread inside that destructor and the process aborts ("terminate called without an active
    exception", exit 134). So the main thread waits for that last step before exiting."""
    tid = getattr(thread, "native_id", None)
    tasks = Path("/proc/self/task")
    if tid is None:
        return
    if not tasks.is_dir():  # no /proc (macOS): give the thread's teardown a moment
        time.sleep(0.2)
        return
    deadline = time.monotonic() + timeout_s
    while (tasks / str(tid)).exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _load_now(provider: StreamingModelProvider, args: argparse.Namespace) -> None:
    """The model (and a draft model) loaded here, in the main thread, as ``generate`` loads it;
    mlx-lm's generation thread then finds it loaded."""
    try:
        provider.load_default()
    except MoefluxError:
        raise
    except Exception as e:  # noqa: BLE001 - mlx-lm's loaders (draft model, tokenizer) raise many
        what = f"--draft-model {args.draft_model}" if args.draft_model else args.model
        raise UsageError(f"{what}: could not be loaded ({type(e).__name__}: {e})") from None


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    config = read_config(path)
    if not has_routed_experts(path):
        raise CheckpointError(
            f"{path}: no routed experts (stacked SwitchGLU / SwitchMLP tensors); nothing to stream "
            "(serve it with mlx_lm.server)"
        )
    options = load_options(args)
    if args.prompt_lookup and args.draft_model is not None:
        raise UsageError(
            "--prompt-lookup and --draft-model are two ways to draft tokens: give one of them"
        )
    group = distributed()  # under mlx.launch: rank 0 serves, every process holds its share
    if group is not None:
        given = [
            flag
            for flag, value in (
                ("--draft-model", args.draft_model),
                ("--adapter-path", args.adapter_path),
                ("--prompt-lookup", args.prompt_lookup),
            )
            if value
        ]
        if given:
            raise UsageError(f"{' and '.join(given)}: not supported under mlx.launch")
    if args.prompt_lookup:  # requests that do not say num_draft_tokens draft K tokens
        args.num_draft_tokens = args.prompt_lookup
    if args.draft_model is not None:
        args.draft_model = str(resolve_model(args.draft_model))
    # the expert files are checked here, in one line, before the port is taken (under
    # mlx.launch each process checks its own share as it loads it)
    if group is None:
        open_store(path, options.expert_io, options.threads)[0].close()
    limit = args.max_tokens_limit or context_length(config)
    if limit is not None and args.max_tokens > limit:
        raise UsageError(
            f"--max-tokens {args.max_tokens} is more than --max-tokens-limit {limit}"
            + ("" if args.max_tokens_limit else " (the model's context length)")
        )
    args.model = str(path.resolve())  # the id /v1/models lists, and what requests may name
    if args.verbose:
        args.log_level = "INFO"
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s - %(levelname)s - %(name)s: %(message)s")
    logging.getLogger().setLevel(level)  # the command's own setup configured the root already
    serve(args, options, limit, 0 if group is None else group.rank())
    return 0


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="host to listen on (default: 127.0.0.1)"
    )
    parser.add_argument(
        "--port",
        type=int_at_least(0, 65535),
        default=8080,
        help="port (default: 8080; 0: any free port)",
    )
    parser.add_argument(
        "--max-tokens-limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="refuse requests for more than N tokens (default: the model's context length, "
        "max_position_embeddings of config.json)",
    )
    add_load_args(parser)
    add_lookup_args(parser)
    group = parser.add_argument_group("mlx_lm.server's options")
    for flag, kwargs in MLX_SERVER_FLAGS:
        group.add_argument(flag, **kwargs)


def main(argv: Optional[list] = None) -> int:
    parser = command_parser(
        "server",
        DESCRIPTION,
        add_args,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return main_for(parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
