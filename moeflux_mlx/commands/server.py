"""``moeflux-mlx server``: mlx-lm's OpenAI-compatible HTTP server on a streaming model.

Nothing here serves HTTP. mlx-lm's server takes its models from a ``ModelProvider`` given to
``mlx_lm.server.run``; ``StreamingModelProvider`` is one whose checkpoints with routed experts are
loaded by ``moeflux_mlx.load``. Everything else (routes, batching, prompt cache, sampling
defaults) is mlx-lm's own. A checkpoint without routed experts (e.g. a dense ``--draft-model``)
still goes to mlx-lm's loader.

The command declares mlx_lm.server's own flags (``MLX_SERVER_FLAGS``), with its defaults, so that
``--help`` shows them and the provider gets the arguments mlx-lm's server reads;
``tests/test_server.py`` checks them against the attributes mlx-lm's server reads.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx_lm
import mlx_lm.server as mlx_server
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.utils import load_config, maybe_set_recommended_wired_limit

from ..errors import CheckpointError
from ..format.checkpoint import EXPERT_KEY, is_packed, read_config
from ..format.safetensors import index_directory
from ..io.store import open_store
from ..model.load import load
from ..options import LoadOptions
from .common import (
    add_load_args,
    add_model_arg,
    command_parser,
    load_options,
    main_for,
    resolve_model,
    say,
)

log = logging.getLogger(__name__)

DESCRIPTION = "serve a streaming model through mlx-lm's OpenAI-compatible HTTP server"
EPILOG = """\
The options after the streaming ones are mlx_lm.server's, with its defaults.

Endpoints (mlx-lm): POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health.
"""

# mlx_lm.server's flags (version 0.32), as its own ``main`` declares them: (flag, keywords).
MLX_SERVER_FLAGS = (
    ("--adapter-path", dict(type=str, help="trained adapter weights (not with streamed experts)")),
    (
        "--allowed-origins",
        dict(type=lambda x: x.split(","), default="*", help="allowed origins (default: *)"),
    ),
    ("--draft-model", dict(type=str, default=None, help="a model for speculative decoding")),
    ("--num-draft-tokens", dict(type=int, default=3, help="tokens to draft (default: 3)")),
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
    ("--top-k", dict(type=int, default=0, help="default top-k (default: 0, off)")),
    ("--min-p", dict(type=float, default=0.0, help="default min-p (default: 0.0, off)")),
    ("--max-tokens", dict(type=int, default=512, help="default maximum tokens (default: 512)")),
    (
        "--chat-template-args",
        dict(type=json.loads, default="{}", help="JSON arguments for apply_chat_template"),
    ),
    ("--decode-concurrency", dict(type=int, default=32, help="batched decode requests")),
    ("--prompt-concurrency", dict(type=int, default=8, help="batched prompts")),
    ("--prefill-step-size", dict(type=int, default=2048, help="prefill step (default: 2048)")),
    ("--prompt-cache-size", dict(type=int, default=10, help="distinct KV caches kept")),
    (
        "--prompt-cache-bytes",
        dict(type=mlx_server._parse_size, help="maximum size in bytes of the KV caches"),
    ),
    ("--kv-bits", dict(type=int, default=None, help="KV cache quantization bits (off)")),
    ("--kv-group-size", dict(type=int, default=64, help="KV cache quantization group size")),
    (
        "--quantized-kv-start",
        dict(
            type=int,
            default=mlx_server.DEFAULT_QUANTIZED_KV_START,
            help="token position where KV cache quantization starts",
        ),
    ),
    ("--pipeline", dict(action="store_true", help="pipelining instead of tensor parallelism")),
)


def has_routed_experts(path: Path) -> bool:
    """Headers only: a converted directory, or safetensors with stacked ``switch_mlp`` experts."""
    path = Path(path)
    return is_packed(path) or any(EXPERT_KEY.match(name) for name in index_directory(path))


class StreamingModelProvider(mlx_server.ModelProvider):
    """mlx-lm's ``ModelProvider``, loading checkpoints with routed experts through
    ``moeflux_mlx.load`` with ``options``; other checkpoints as mlx-lm does."""

    def __init__(self, cli_args: argparse.Namespace, options: LoadOptions):
        super().__init__(cli_args)
        self.options = options

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        path = resolve_model(str(model_path))
        if not has_routed_experts(path):
            log.warning("%s has no routed experts: loading it with mlx_lm.load", path)
            return super()._load(str(path), adapter_path, draft_model_path)
        if adapter_path is not None:
            raise CheckpointError(
                f"{adapter_path}: adapters are not supported with streamed experts"
            )
        if self.is_distributed:
            raise CheckpointError(f"{path}: streamed experts do not run distributed yet")
        # as mlx-lm's provider does: the old model's buffers go back before the new one loads
        self.reset()
        gc.collect()
        mx.clear_cache()
        log.info("loading %s with moeflux_mlx.load (experts stream from disk)", path)
        model, tokenizer = load(path, tokenizer_config=self._tokenizer_config, options=self.options)
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


def _stop(signum, frame):
    raise KeyboardInterrupt  # mlx-lm's server shuts down cleanly on it


def serve(args: argparse.Namespace, options: LoadOptions) -> None:
    """Run mlx-lm's server on ``args`` (mlx_lm.server's arguments) with experts streamed by
    ``options``; blocks until Ctrl-C or SIGTERM."""
    maybe_set_recommended_wired_limit()
    signal.signal(signal.SIGTERM, _stop)
    mlx_server.run(args.host, args.port, StreamingModelProvider(args, options))


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    read_config(path)
    if not has_routed_experts(path):
        raise CheckpointError(
            f"{path}: no routed experts (switch_mlp tensors); nothing to stream "
            "(serve it with mlx_lm.server)"
        )
    options = load_options(args)
    # the expert files are checked here, in one line, rather than in the generation thread
    open_store(path, options.expert_io, options.threads)[0].close()
    args.model = str(path)
    if args.verbose:
        args.log_level = "INFO"
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s - %(levelname)s - %(name)s: %(message)s",
    )
    say(
        f"Serving {path} on http://{args.host}:{args.port}/v1 (mlx-lm server, experts streamed; "
        "Ctrl-C stops)"
    )
    serve(args, options)
    return 0


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="host to listen on (default: 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    add_load_args(parser)
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
