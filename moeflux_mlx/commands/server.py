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
thread died). Its request handler (``StreamingAPIHandler``, a subclass of mlx-lm's) is made safe
to put in front of clients; one log line at start lists every limit:

- access: with ``--api-key`` / ``--api-key-file`` / ``MOEFLUX_API_KEY`` every GET and POST needs
  ``Authorization: Bearer <key>`` (401 otherwise, compared in constant time); a request's
  ``model`` may load only ``--model`` and ``--allowed-models`` (404 otherwise, no disk access);
  listening beyond loopback without a key logs a warning;
- bodies: over ``--max-body-bytes`` 413 before they are read; no length or chunked 411; not
  JSON 415/400;
- fields: every field mlx-lm reads is checked for type and range (OpenAI's) and against the model
  (token ids below its vocabulary, sizes within its context) before any work
  (``server_checks``: 400 naming the field; the same checks guard ``ResponseGenerator.generate``);
- prompts: longer than the context or ``--max-prompt-tokens``, 400 with both counts before any
  prefill; ``max_tokens`` above ``--max-tokens-limit`` (default: the context), 400;
- work stops when its client leaves or ``--request-timeout`` passes, checked at every prefill
  step and every token (mlx-lm notices a client gone only when a write fails);
- ``--max-connections`` caps the handler threads (503 beyond), a silent client is dropped after
  ``IDLE_TIMEOUT_S``; errors are OpenAI-shaped, their text written for the client;
- ``GET /v1/models`` lists the served model even where no Hugging Face cache folder exists
  (mlx-lm's scan of that cache raises there), and ``GET /v1/models/ID`` returns one model.

With ``--prompt-lookup K`` the provider's draft model is a ``PromptLookup``, which holds no
weights: being a draft model, it makes mlx-lm serve each request alone (not batched) through
``stream_generate``, and ``serve`` makes mlx_lm.server's ``stream_generate`` one that sends such
requests to ``stream_lookup_generate`` (``lookup_stream_generate``). Greedy replies are the
tokens of decoding without it.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import errno
import gc
import io
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
from typing import Any, Dict, List, Optional, Tuple, Type, cast

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
from ..model.runtime import MLX_LM_PREFILL_STEP
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
from .server_checks import (
    ModelLimits,
    RequestError,
    bearer_matches,
    check_generation_args,
    check_object,
    check_prompt_length,
    check_request,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 60  # a client silent this long (request unsent, reply unread) is dropped
IDLE_CLEAR_S = 2.0  # with no connection open this long, MLX's buffer cache is given back


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system where the C library can (glibc's
    ``malloc_trim``): each connection thread frees into an arena of its own, which glibc keeps
    (the load test's idle server, demo model, 2-core CPU: 178 MiB with it, 317-520 without)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


FALLBACK_CONTEXT = 32768  # prompts and sizes where config.json gives no context length
API_KEY_VARIABLE = "MOEFLUX_API_KEY"
# Hugging Face tokenizers are not safe to call from two threads at once: the handlers (counting
# a prompt's tokens) and the generation thread (tokenizing it) take turns
TOKENIZER_LOCK = threading.Lock()

DESCRIPTION = "serve a streaming model through mlx-lm's OpenAI-compatible HTTP server"
EPILOG = """\
The options after the streaming ones are mlx_lm.server's, with its defaults.

Endpoints (mlx-lm): POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health.
Every request field is checked against the model before any work (400 naming the field); prompts
over the context or --max-prompt-tokens (400) and bodies over --max-body-bytes (413) are refused;
--api-key requires a bearer key; --allowed-models limits what "model" may load. Generation stops
when the client disconnects or --request-timeout passes, during the prefill too.
With --prompt-lookup K requests are served one at a time (not batched), each
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


def _body_size(text: str) -> int:
    """``--max-body-bytes``: a number of bytes, or a size such as 4MB."""
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    size = _kv_cache_bytes(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a size above 0, got {text!r}")
    return size


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
        dict(
            type=positive_int,
            default=None,
            help="prompt tokens per forward pass while prefilling (default: the loaded model's "
            "choice: 2048, as mlx-lm, where every expert is resident; larger where experts "
            "stream, so a prompt reads them fewer times)",
        ),
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
        # --prefill-step-size as given (None: each loaded model's own choice, set on load)
        self.given_prefill_step = getattr(cli_args, "prefill_step_size", None)

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
            self.cli_args.prefill_step_size = self.given_prefill_step or MLX_LM_PREFILL_STEP
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
        # mlx-lm's server reads the step from its arguments at each request
        self.cli_args.prefill_step_size = self.given_prefill_step or model.moeflux.prefill_step_size
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


class RequestAbandoned(Exception):
    """Raised in the generation thread, from a prefill's progress callback, when the request's
    handler has stopped it (client gone, time limit): the prefill ends between two steps."""


class _StoppableQueue:
    """A request's response queue, as ``ResponseGenerator._serve_single`` fills it: a progress
    report (put between prefill steps) of a request whose context was stopped raises
    ``RequestAbandoned`` instead, which ends the prefill there."""

    def __init__(self, queue: Any):
        self._queue = queue
        self._ctx: Optional[Any] = None  # the request's GenerationContext, once mlx-lm made it

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)

    def put(self, item, *args, **kwargs) -> None:
        if isinstance(item, mlx_server.GenerationContext):
            self._ctx = item
        elif isinstance(item, tuple) and self._ctx is not None and self._ctx._should_stop:
            raise RequestAbandoned("the request was abandoned during its prefill")
        self._queue.put(item, *args, **kwargs)


class StreamingResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's ``ResponseGenerator``, with three additions:

    - ``generate`` checks a request's arguments against the model (``check_generation_args``)
      before it is queued, so no caller can hand the sampler a token id past the vocabulary;
    - ``_tokenize`` (in the generation thread) refuses a prompt longer than the server takes,
      before any prefill, and shares one lock with the handlers' token counts (a Hugging Face
      tokenizer is not safe to call from two threads at once);
    - a request served alone (``_serve_single``: a seed, a draft model) stops between two prefill
      steps once its context is stopped (``_StoppableQueue``); batched requests leave the batch
      after the step that noticed the stop (no time budget between those checks).

    With prompt lookup, it also gives the ``PromptLookup`` each request's whole prompt
    (``stream_generate`` gets only the part the prompt cache lacks).

    ``models`` maps each model name a request may give to ``(path, ModelLimits)``; ``serve``
    sets it (empty: no checks).
    """

    models: Any = {}  # a ModelTable (or a dict of name: (path, limits))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # mlx-lm's batch loop drops the requests stopped during a time budget (0.5 s of steps)
        # only once the budget is spent; with none, after the very step that noticed the stop,
        # so a client that leaves frees the loop within one prefill step or one token
        self._time_budget = mlx_server.TimeBudget(budget=0.0)

    def limits_for(self, name: Optional[str]) -> Optional[ModelLimits]:
        """Returns: the limits of the model a request names, or None where none are known."""
        entry = self.models.get(name or "default_model")
        return entry[1] if entry else None

    def generate(self, request, generation_args, progress_callback=None):
        limits = self.limits_for(generation_args.model.model)
        if limits is not None:
            check_generation_args(generation_args, limits)
        return super().generate(request, generation_args, progress_callback=progress_callback)

    def _tokenize(self, tokenizer, request, args):
        with TOKENIZER_LOCK:
            out = super()._tokenize(tokenizer, request, args)
        limits = self.limits_for(args.model.model)
        if limits is not None:
            check_prompt_length(
                len(out[0]), limits, "messages" if request.request_type == "chat" else "prompt"
            )
        draft = self.model_provider.draft_model
        if isinstance(draft, PromptLookup):
            draft.prompt = list(out[0])
        return out

    def _serve_single(self, request, stream):
        rqueue, request, args = request
        return super()._serve_single((_StoppableQueue(rqueue), request, args), stream)


class ClientGone(ConnectionAbortedError):
    """The client closed its connection while its reply was being generated."""


class RequestTimedOut(Exception):
    """A request's ``--request-timeout`` passed before its first token."""


def client_gone(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` closed the connection (readable, and nothing to read).

    Args:
        sock: the connection.

    Returns:
        True when the peer has closed it (or it is reset or closed).
    """
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed
        return True


class _WatchedResponses:
    """mlx-lm's ``ResponseGenerator`` as one request's handler sees it: generation stops
    (``ctx.stop()``) as soon as the client has gone away or the request's time limit has passed,
    checked at every prefill progress report (one per prefill step) and every token. mlx-lm
    notices a client gone only when a write fails, and a non-streamed reply writes nothing until
    the end. A refusal from the generator (``RequestError``) or an internal failure is kept on
    the handler, which answers it in OpenAI's shape (``StreamingAPIHandler``)."""

    def __init__(self, inner: Any, handler: StreamingAPIHandler):
        self._inner, self._handler = inner, handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, request, args, progress_callback=None):
        holder: dict = {}

        def progress(done: int, total: int) -> None:
            self._check(holder.get("ctx"), f"during its prefill ({done}/{total} prompt tokens)")
            if progress_callback is not None:
                progress_callback(done, total)

        try:
            ctx, responses = self._inner.generate(request, args, progress_callback=progress)
        except RequestError as e:
            self._handler._pending_error = e
            raise
        except Exception as e:
            log.error("request failed before its first token: %s: %s", type(e).__name__, e)
            self._handler._pending_error = RequestError(
                "the server could not generate a reply (see its log)",
                status=500,
                kind="server_error",
            )
            raise
        holder["ctx"] = ctx
        return ctx, self._watch(ctx, responses)

    def _check(self, ctx, when: str) -> None:
        handler = self._handler
        if client_gone(handler.connection):
            if ctx is not None:
                ctx.stop()
            raise ClientGone(f"the client went away {when}: generation stopped")
        if handler._deadline is not None and time.monotonic() > handler._deadline:
            if ctx is not None:
                ctx.stop()
            raise RequestTimedOut(f"--request-timeout passed {when}")

    def _watch(self, ctx, responses):
        n = 0
        for response in responses:
            n += 1
            try:
                self._check(ctx, f"after {n} tokens")
            except RequestTimedOut:
                log.info("--request-timeout passed after %d tokens: generation stopped", n)
                if response.finish_reason is None:
                    response.finish_reason = "length"
                yield response
                return
            yield response


class _OpenAIErrors:
    """The handler's output, with mlx-lm's error bodies (``{"error": "text"}``) in OpenAI's
    shape (``{"error": {"message": "text", ...}}``), the one clients read the message from (the
    ``openai`` package shows only "Error code: 400" otherwise). An error the handler kept
    (``_pending_error``) replaces mlx-lm's text, which would be an internal exception's.
    Everything else passes as is."""

    def __init__(self, out: Any, handler: StreamingAPIHandler):
        self._out, self._handler = out, handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)

    def write(self, data) -> int:
        status = getattr(self._handler, "_status", 200)
        if status >= 400 and bytes(data[:10]).startswith(b'{"error":'):
            pending = getattr(self._handler, "_pending_error", None)
            try:
                body = json.loads(bytes(data))
            except ValueError:
                body = None
            if pending is not None:
                data = json.dumps(pending.body()).encode()
            elif isinstance(body, dict) and isinstance(body.get("error"), str):
                kind = "invalid_request_error" if status < 500 else "server_error"
                error = {"message": body["error"], "type": kind, "param": None, "code": None}
                data = json.dumps({"error": error}).encode()
        return self._out.write(data)


def _reject_constant(name: str) -> None:
    raise RequestError(f"the request body is not JSON ({name} is not a JSON number)")


class StreamingAPIHandler(mlx_server.APIHandler):
    """mlx-lm's request handler, made safe to put in front of clients:

    - with ``api_key`` set, every GET and POST needs ``Authorization: Bearer <key>`` (401);
    - a POST body is refused before it is read when it is larger than ``max_body_bytes`` (413)
      or has no length (411), and before any work when it is not UTF-8 JSON (400) or any field
      is out of type or range for this model (400 naming the field; ``server_checks``);
    - a request's ``model`` must be one of ``models`` (404, without touching the disk);
    - a prompt longer than the model's limits is refused with both counts before any prefill;
    - generation stops when the client disconnects or ``request_timeout`` passes, during the
      prefill too (``_WatchedResponses``);
    - ``GET /v1/models`` lists the served model even where no Hugging Face cache folder
      exists, and ``GET /v1/models/ID`` returns one model;
    - every error is in OpenAI's shape, its text written for the client.

    ``serve`` makes a subclass that sets the class attributes below. A silent client is dropped
    after ``timeout`` seconds (``IDLE_TIMEOUT_S``: reading its request, or writing to it).
    """

    served_model: str = ""
    max_tokens_limit: Optional[int] = None
    models: Any = {}  # a ModelTable
    api_key: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout: float = 0.0
    default_max_tokens: int = 512
    timeout = IDLE_TIMEOUT_S

    def __init__(self, response_generator, *args, **kwargs):
        self._status = 200
        self._pending_error: Optional[RequestError] = None
        self._deadline: Optional[float] = None
        super().__init__(_WatchedResponses(response_generator, self), *args, **kwargs)

    def setup(self) -> None:
        super().setup()
        # a wrapper with the file's interface: mlx-lm's handler writes through it unchanged
        self.wfile = cast(io.BufferedIOBase, _OpenAIErrors(self.wfile, self))

    def send_response(self, code, message=None) -> None:
        self._status = code
        super().send_response(code, message)

    def _set_completion_headers(self, status_code: int = 200) -> None:
        # mlx-lm answers any failure of ``generate`` with 404; a kept error has its own status
        if status_code == 404 and self._pending_error is not None:
            status_code = self._pending_error.status
        super()._set_completion_headers(status_code)

    def log_message(self, format, *args) -> None:
        log.info("%s %s", self.address_string(), format % args)

    # ----------------------------------------------------------------- errors and access
    def _send_error(self, error: RequestError, headers: Optional[dict] = None) -> None:
        self._pending_error = None
        data = json.dumps(error.body()).encode()
        self._set_completion_headers(error.status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _authorized(self) -> bool:
        """Sends 401 and returns False when a key is required and not given."""
        if self.api_key is None or bearer_matches(self.headers.get("Authorization"), self.api_key):
            return True
        self.close_connection = True
        self._send_error(
            RequestError(
                "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                status=401,
                kind="authentication_error",
            ),
            {"WWW-Authenticate": "Bearer"},
        )
        return False

    def _not_found(self) -> None:
        self._send_error(
            RequestError(
                f"no such endpoint: {self.command} {self.path[:100]}",
                code="not_found",
                status=404,
            )
        )

    def do_GET(self) -> None:
        if not self._authorized():
            return
        path = self.path.split("?", 1)[0]
        if path == "/v1/models" or path.startswith("/v1/models/") or path == "/health":
            super().do_GET()
        else:
            self._not_found()

    # ----------------------------------------------------------------- POST
    def _read_body(self) -> Any:
        """The request's JSON body, its size and encoding checked before it is parsed.

        Raises:
            RequestError: 411 (no Content-Length, or chunked), 413 (too large), 415 (not
                JSON's content type), 400 (short, not UTF-8, not JSON).
        """
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            raise RequestError(
                "chunked request bodies are not accepted: send a Content-Length",
                code="length_required",
                status=411,
            )
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise RequestError(
                "a Content-Length header is required", code="length_required", status=411
            )
        if not length.strip().isdigit():
            self.close_connection = True
            raise RequestError("the Content-Length header is not a number of bytes")
        size = int(length)
        if size > self.max_body_bytes:
            self.close_connection = True  # the body is not read: the connection cannot go on
            raise RequestError(
                f"the request body is {size} bytes, more than this server accepts "
                f"({self.max_body_bytes}, its --max-body-bytes)",
                code="request_too_large",
                status=413,
            )
        kind = (self.headers.get("Content-Type") or "application/json").split(";")[0]
        kind = kind.strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            self.close_connection = True
            raise RequestError(
                f"the request body must be JSON (Content-Type: application/json), not {kind[:60]}",
                code="unsupported_media_type",
                status=415,
            )
        raw = self.rfile.read(size)
        if len(raw) != size:
            self.close_connection = True
            raise RequestError("the request body is shorter than its Content-Length")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("the request body is not UTF-8 text") from None
        try:
            return json.loads(text, parse_constant=_reject_constant)
        except RequestError:
            raise
        except RecursionError:
            raise RequestError("the request body is nested too deeply") from None
        except ValueError as e:
            raise RequestError(f"the request body is not JSON ({e})") from None

    def _check_models(self, body: dict) -> Tuple[str, ModelLimits]:
        requested = body.get("model") or "default_model"
        if not isinstance(requested, str):
            raise RequestError("model must be a string", "model")
        entry = self.models.get(requested)
        if entry is None:
            raise RequestError(
                f"model {requested[:200]!r} is not served here; GET /v1/models lists what is",
                "model",
                "model_not_found",
                status=404,
            )
        cli = self.response_generator.cli_args
        for name, default in (("draft_model", cli.draft_model), ("adapters", cli.adapter_path)):
            value = body.get(name)
            if value not in (None, "default_model") and value != default:
                raise RequestError(
                    f"{name}: only the one given when the server started may be used",
                    name,
                    "model_not_found",
                    status=404,
                )
        return entry

    def _prompt_tokens(self, body: dict, endpoint: str, path: str) -> Optional[int]:
        """The prompt's tokens, as mlx-lm's generation thread will count them; None where the
        model the request names is not the one loaded (the generation thread checks it)."""
        provider = self.response_generator.model_provider
        tokenizer = provider.tokenizer
        if tokenizer is None or provider.model_key is None or str(provider.model_key[0]) != path:
            return None
        try:
            with TOKENIZER_LOCK:
                if endpoint == "text":
                    return len(tokenizer.encode(body["prompt"]))
                messages = copy.deepcopy(body["messages"])
                if not tokenizer.has_chat_template:
                    text = mlx_server.convert_chat(messages, body.get("role_mapping"))
                    return len(tokenizer.encode(text))
                urls = mlx_server.process_message_content(
                    messages, keep_images=provider.processor is not None
                )
                if urls:
                    return None  # images: counted by the generation thread
                kwargs = dict(self.response_generator.cli_args.chat_template_args)
                kwargs.update(body.get("chat_template_kwargs") or {})
                prompt = tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=True,
                    tools=body.get("tools") or None,
                    tokenize=True,
                    **kwargs,
                )
                return len(prompt)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception, a bad message
            log.info("prompt refused: %s: %s", type(e).__name__, e)
            why = getattr(e, "message", None) if type(e).__name__ == "TemplateError" else None
            raise RequestError(
                "the model's chat template cannot render these messages"
                + (f": {str(why)[:300]}" if why else ""),
                "messages" if endpoint == "chat" else "prompt",
            ) from None

    def do_POST(self) -> None:
        endpoints = {
            "/v1/completions": "text",
            "/v1/chat/completions": "chat",
            "/chat/completions": "chat",
        }
        endpoint = endpoints.get(self.path)
        if endpoint is None:
            self.close_connection = True
            self._not_found()
            return
        if not self._authorized():
            return
        if self.request_timeout:
            self._deadline = time.monotonic() + self.request_timeout
        try:
            body = self._read_body()
            images = self.response_generator.model_provider.processor is not None
            check_object(body)  # before any model's limits are looked up
            path, limits = self._check_models(body)
            body = check_request(body, endpoint, limits, self.default_max_tokens, images)
            n = self._prompt_tokens(body, endpoint, path)
            if n is not None:
                check_prompt_length(n, limits, "messages" if endpoint == "chat" else "prompt")
        except RequestError as e:
            log.info("request refused (%d): %s", e.status, e.message)
            self._send_error(e)
            return
        except (ConnectionError, TimeoutError):
            raise
        except Exception:  # noqa: BLE001 - a check's own failure: refused, never a crash
            log.exception("request refused: its checks failed")
            self._send_error(RequestError("the request could not be checked; see the server's log"))
            return
        # mlx-lm's handler reads the checked body (normalized: floats where it wants floats)
        data = json.dumps(body).encode()
        rfile = self.rfile
        self.rfile = io.BytesIO(data)
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(data))
        try:
            super().do_POST()
        finally:
            self.rfile = rfile

    def handle_completion(self, request, stop_words) -> None:
        try:
            super().handle_completion(request, stop_words)
        except RequestTimedOut as e:
            log.info("%s: generation stopped", e)
            error = RequestError(
                f"the request took longer than this server's --request-timeout "
                f"({self.request_timeout:g} s)",
                code="request_timeout",
                status=408,
                kind="timeout_error",
            )
            self.close_connection = True
            if not self.stream:  # nothing sent yet: mlx-lm's 200 is still in the buffer
                self._headers_buffer: List[bytes] = []
                self._send_error(error)
            else:
                self.wfile.write(f"data: {json.dumps(error.body())}\n\n".encode())
                self.wfile.flush()

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
        names = self.models.names() if hasattr(self.models, "names") else []
        models += [self._model(n, "moeflux-mlx") for n in names if n != self.served_model]
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


_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\n\r\n"
    b'{"error": {"message": "the server has as many connections as it takes (its '
    b'--max-connections); try again", "type": "server_error", "param": null, '
    b'"code": "server_busy"}}'
)


class StreamingHTTPServer(ThreadingHTTPServer):
    """mlx-lm's server class, made to say a dropped or silent connection in one log line
    rather than a traceback, and to hold at most ``max_connections`` connections at once (each
    is a thread): one more is answered 503 and closed."""

    daemon_threads = True  # a request still being answered does not hold the process at exit
    max_connections = 0  # 0: no limit
    # connections open now: written only by the connection threads, under ``_count_lock``
    _open = 0
    _count_lock = threading.Lock()
    # socketserver's backlog of 5 resets clients that connect together (32 at once, say)
    request_queue_size = 128

    def set_max_connections(self, n: int) -> None:
        """Args:
        n: the most connections served at once (0: no limit)."""
        self.max_connections = n
        self._slots = threading.BoundedSemaphore(n) if n else None

    def process_request(self, request, client_address) -> None:
        slots = getattr(self, "_slots", None)
        if slots is not None and not slots.acquire(blocking=False):
            log.warning("%s: refused (503): --max-connections reached", client_address[0])
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        with self._count_lock:
            self._open += 1
        try:
            super().process_request_thread(request, client_address)
        finally:
            slots = getattr(self, "_slots", None)
            if slots is not None:
                slots.release()
            with self._count_lock:
                self._open -= 1
                if self._open == 0:  # the last client gone: give memory back once idle
                    timer = threading.Timer(IDLE_CLEAR_S, self._clear_if_idle)
                    timer.daemon = True
                    timer.start()

    def _clear_if_idle(self) -> None:
        """MLX keeps the buffers of finished requests for reuse, and the C heap keeps what the
        connection threads freed; with no connection open for ``IDLE_CLEAR_S`` both go back to
        the system (a later request allocates anew)."""
        with self._count_lock:
            if self._open == 0:
                mx.clear_cache()
                _trim_heap()

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):  # ClientGone, pipe, reset, silent
            log.info("%s: %s", client_address[0], error or type(error).__name__)
            return
        super().handle_error(request, client_address)


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


def _config_int(config: dict, key: str) -> Optional[int]:
    for section in (config.get("text_config") or {}, config):
        value = section.get(key) if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def context_length(config: dict) -> Optional[int]:
    """The model's context length (``max_position_embeddings``), None when config.json lacks it."""
    return _config_int(config, "max_position_embeddings")


def model_limits(
    config: dict,
    max_tokens_limit: Optional[int] = None,
    max_prompt_tokens: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> ModelLimits:
    """What requests may ask of a model with ``config`` (its config.json).

    Args:
        config: the model's config.
        max_tokens_limit: ``--max-tokens-limit`` (None: the context length).
        max_prompt_tokens: ``--max-prompt-tokens`` (None: the context length; never more).
        vocab_size: where config.json lacks ``vocab_size``, the model's (its logits' rows).

    Returns:
        The limits.

    Raises:
        UsageError: config.json gives no vocabulary size and none is given.
    """
    vocab = _config_int(config, "vocab_size") or vocab_size
    if vocab is None:
        raise UsageError("config.json has no vocab_size: cannot check token ids of requests")
    context = context_length(config) or FALLBACK_CONTEXT
    prompt = min(max_prompt_tokens or context, context)
    return ModelLimits(vocab, context, prompt, max_tokens_limit or context)


class ModelTable:
    """The models requests may name (``--allowed-models``), each as ``(path, ModelLimits)``,
    under every name it may be given by: ``default_model``, the name given at start, its path.
    Looking a name up touches no disk, except with ``*`` (any model: its config is read once).
    """

    def __init__(
        self,
        entries: Dict[str, Tuple[str, ModelLimits]],
        any_model: bool = False,
        max_tokens_limit: Optional[int] = None,
        max_prompt_tokens: Optional[int] = None,
    ):
        self._entries = dict(entries)
        self.listed: List[str] = []
        self.any_model = any_model
        self._limits = (max_tokens_limit, max_prompt_tokens)
        self._lock = threading.Lock()

    def get(self, name: Optional[str]) -> Optional[Tuple[str, ModelLimits]]:
        """Args:
            name: a request's ``model`` (None: ``default_model``).

        Returns:
            ``(path, limits)``, or None where the name may not be loaded (or, with ``*``, is
            not a model's directory).
        """
        name = name or "default_model"
        with self._lock:
            if name in self._entries or not self.any_model:
                return self._entries.get(name)
        try:
            path = resolve_model(name)
            entry = (name, model_limits(read_config(path), *self._limits))
        except Exception as e:  # noqa: BLE001 - not a model: the request is refused
            log.info("model %r not loadable: %s", name[:200], e)
            return None
        with self._lock:
            self._entries[name] = entry
        return entry

    def names(self) -> List[str]:
        """Returns: the models ``--allowed-models`` names, as given (what /v1/models lists)."""
        return list(self.listed)


def resolve_api_key(args: argparse.Namespace) -> Optional[str]:
    """The key requests must send: ``--api-key``, ``--api-key-file``, or ``MOEFLUX_API_KEY``.

    Args:
        args: the command's arguments.

    Returns:
        The key, or None where none is set (no key required).

    Raises:
        UsageError: both flags given, the file unreadable, or the key empty or not printable
            ASCII without spaces (what an HTTP header carries).
    """
    if args.api_key is not None and args.api_key_file is not None:
        raise UsageError("--api-key and --api-key-file: give one of them")
    if args.api_key_file is not None:
        try:
            key, source = Path(args.api_key_file).read_text().strip(), "--api-key-file"
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: cannot be read ({e})") from None
    elif args.api_key is not None:
        key, source = args.api_key.strip(), "--api-key"
    else:
        key, source = os.environ.get(API_KEY_VARIABLE, "").strip(), API_KEY_VARIABLE
        if not key:
            return None
    if not key or not all(33 <= ord(c) < 127 for c in key):
        raise UsageError(f"{source}: the key must be printable ASCII without spaces, not empty")
    return key


def _allowed_models(args: argparse.Namespace, served: ModelLimits) -> ModelTable:
    entries = {"default_model": (args.model, served), args.model: (args.model, served)}
    if getattr(args, "model_given", None):
        entries[args.model_given] = (args.model, served)
    any_model = False
    for name in getattr(args, "allowed_models", None) or []:
        if name == "*":
            any_model = True
            continue
        path = resolve_model(name)
        limits = model_limits(read_config(path), args.max_tokens_limit, args.max_prompt_tokens)
        entries[name] = entries[str(path.resolve())] = (str(path.resolve()), limits)
    table = ModelTable(entries, any_model, args.max_tokens_limit, args.max_prompt_tokens)
    table.listed = [n for n in getattr(args, "allowed_models", None) or [] if n != "*"]
    return table


def serve(
    args: argparse.Namespace,
    options: LoadOptions,
    max_tokens_limit: Optional[int] = None,
    rank: int = 0,
) -> None:
    """Run mlx-lm's server on ``args`` (mlx_lm.server's arguments and this command's limits)
    with experts streamed by ``options``; blocks until Ctrl-C or SIGTERM.

    The port is taken first and the model loaded in full before a request is accepted, so a port
    in use or a damaged model is one line (``UsageError``, ``MoefluxError``), never a server that
    listens with a dead generation thread. Under mlx.launch only rank 0 listens; the other
    processes load their share and generate with it, as in mlx-lm's server (``rank`` > 0).

    Args:
        args: the command's arguments (``run`` has resolved ``model`` and the API key).
        options: how experts are streamed.
        max_tokens_limit: the most tokens a request may ask for (None: the context length).
        rank: this process's rank under mlx.launch (0: the one that listens).

    Raises:
        UsageError: the port cannot be taken, or the model or an allowed model cannot be loaded.
    """
    signal.signal(signal.SIGTERM, _stop)
    if rank > 0:
        _serve_share(args, options)
        return
    api_key = getattr(args, "resolved_api_key", None)
    handler_class: Type[StreamingAPIHandler] = type(
        "Handler",
        (StreamingAPIHandler,),
        {
            "served_model": str(Path(args.model).resolve()),
            "max_tokens_limit": max_tokens_limit,
            "api_key": api_key,
            "max_body_bytes": getattr(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES),
            "request_timeout": getattr(args, "request_timeout", 0.0) or 0.0,
            "default_max_tokens": args.max_tokens,
        },
    )
    holder: dict = {}
    httpd = listen(args.host, args.port, handler_class, lambda: holder["responses"])
    httpd.set_max_connections(getattr(args, "max_connections", DEFAULT_MAX_CONNECTIONS))
    if not ipaddress.ip_address(str(httpd.server_address[0])).is_loopback:
        log.warning(
            "listening on %s, beyond this machine%s",
            args.host,
            "" if api_key else ": without --api-key, anyone who reaches this port can generate",
        )
    provider = StreamingModelProvider(args, options)
    plain_stream_generate = mlx_server.stream_generate
    try:
        maybe_set_recommended_wired_limit()
        _load_now(provider, args)
        config = read_config(resolve_model(args.model))
        vocab = getattr(getattr(provider.model, "args", None), "vocab_size", None)
        served = model_limits(
            config, max_tokens_limit, getattr(args, "max_prompt_tokens", None), vocab
        )
        models = _allowed_models(args, served)
        handler_class.models = models
        # mlx_lm.server calls stream_generate for requests it serves alone: this one sends those
        # whose draft model is a PromptLookup to prompt lookup, the rest to mlx-lm's own
        # the same call as mlx-lm's, typed loosely: it hands every other request to mlx-lm's
        mlx_server.stream_generate = lookup_stream_generate  # type: ignore[assignment]
        host, port = str(httpd.server_address[0]), httpd.server_address[1]
        timeout = handler_class.request_timeout
        log.info(
            "limits: prompts up to %d tokens%s, max_tokens up to %d, bodies up to %d bytes, "
            "request timeout %s, %s connections at once, silent clients dropped after %d s; "
            "API key %s; models: %s",
            served.max_prompt_tokens,
            " (the model's context)" if served.max_prompt_tokens == served.context_length else "",
            served.max_tokens,
            handler_class.max_body_bytes,
            f"{timeout:g} s" if timeout else "off",
            httpd.max_connections or "any number of",
            IDLE_TIMEOUT_S,
            "required" if api_key else "not required",
            ", ".join([args.model, *models.names()] + (["any (*)"] if models.any_model else [])),
        )
        say(
            f"Serving {args.model} on http://{host}:{port}/v1 (mlx-lm server, experts streamed; "
            f"max_tokens up to {max_tokens_limit or 'any'}; Ctrl-C stops)"
        )
        prompt_cache = mlx_server.LRUPromptCache(args.prompt_cache_size)
        generator_class = type("Responses", (StreamingResponseGenerator,), {"models": models})
        holder["responses"] = responses = generator_class(provider, prompt_cache)
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
        open_store(path, options.expert_io, options.tuning.threads)[0].close()
    limit = args.max_tokens_limit or context_length(config)
    if limit is not None and args.max_tokens > limit:
        raise UsageError(
            f"--max-tokens {args.max_tokens} is more than --max-tokens-limit {limit}"
            + ("" if args.max_tokens_limit else " (the model's context length)")
        )
    context = context_length(config)
    if args.max_prompt_tokens and context and args.max_prompt_tokens > context:
        raise UsageError(
            f"--max-prompt-tokens {args.max_prompt_tokens} is more than the model's context "
            f"length ({context})"
        )
    args.resolved_api_key = resolve_api_key(args)
    args.model_given = args.model
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
    limits = parser.add_argument_group("limits and access")
    limits.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="refuse prompts of more than N tokens, before any prefill (default: the model's "
        "context length, which is also the most it may be)",
    )
    limits.add_argument(
        "--max-body-bytes",
        type=_body_size,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="SIZE",
        help="refuse request bodies larger than SIZE (e.g. 4MB, or bytes) before reading them "
        f"(default: {DEFAULT_MAX_BODY_BYTES // 2**20} MiB)",
    )
    limits.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="stop a request's generation after SECONDS (default: 0, off: max_tokens and the "
        "prompt limit bound every request, and a client that leaves stops its request)",
    )
    limits.add_argument(
        "--max-connections",
        type=int_at_least(0),
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"serve at most N connections at once, answer more with 503 (default: "
        f"{DEFAULT_MAX_CONNECTIONS}; 0: no limit)",
    )
    limits.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every request (default: none; also "
        f"--api-key-file or ${API_KEY_VARIABLE}, which other users cannot see in ps)",
    )
    limits.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="--api-key, read from the file PATH (its first line)",
    )
    limits.add_argument(
        "--allowed-models",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        default=None,
        metavar="M1,M2",
        help='models (directories or Hub ids) a request\'s "model" may load besides --model; '
        "'*' allows any (default: only --model)",
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
