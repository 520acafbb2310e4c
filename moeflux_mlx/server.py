"""``moeflux-mlx server``: mlx-lm's OpenAI-compatible HTTP server on a streaming model.

Nothing here serves HTTP. ``mlx_lm.server.ModelProvider._load`` loads every model through the
name ``load`` of the ``mlx_lm.server`` module; ``serve`` rebinds that one name to
``streaming_load`` and then runs ``mlx_lm.server.main``. So all of mlx-lm's server (its routes,
batching, prompt cache, every flag not declared here) is unchanged, and a checkpoint with routed
experts is loaded by ``moeflux_mlx.load``. A checkpoint without routed experts (e.g. a dense
``--draft-model``) still goes to ``mlx_lm.load``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from .checkpoint import EXPERT_KEY, is_packed, read_config
from .cli import add_load_args, add_model_arg, load_kwargs, resolve_model, say
from .errors import CheckpointError
from .safetensors_index import index_directory

log = logging.getLogger(__name__)

EPILOG = """\
Every other option is mlx_lm.server's and is passed on to it unchanged, e.g. --temp, --top-p,
--max-tokens, --chat-template-args, --prompt-cache-size, --log-level (see `mlx_lm.server --help`).

Endpoints (mlx-lm): POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health.
"""


def has_routed_experts(path: Path) -> bool:
    """Headers only: a converted directory, or safetensors with stacked ``switch_mlp`` experts."""
    path = Path(path)
    return is_packed(path) or any(EXPERT_KEY.match(name) for name in index_directory(path))


def streaming_load(load_options: dict, stock_load):
    """A drop-in for ``mlx_lm.utils.load`` (as ``mlx_lm.server`` calls it) that streams experts."""
    from mlx_lm.utils import load_config

    from .loader import load

    def load_model(path_or_hf_repo, tokenizer_config=None, model_config=None, adapter_path=None,
                   lazy=False, return_config=False, revision=None, trust_remote_code=False):
        path = resolve_model(str(path_or_hf_repo))
        if not has_routed_experts(path):
            log.warning("%s has no routed experts: loading it with mlx_lm.load", path)
            return stock_load(str(path), tokenizer_config=tokenizer_config,
                              model_config=model_config, adapter_path=adapter_path, lazy=lazy,
                              return_config=return_config, revision=revision,
                              trust_remote_code=trust_remote_code)
        if adapter_path is not None:
            raise CheckpointError(f"{adapter_path}: adapters are not supported with streamed "
                                  "experts")
        log.info("loading %s with moeflux_mlx.load (experts stream from disk)", path)
        model, tokenizer = load(path, tokenizer_config=tokenizer_config, model_config=model_config,
                                **load_options)
        return (model, tokenizer, load_config(path)) if return_config else (model, tokenizer)

    return load_model


def _stop(signum, frame):
    raise KeyboardInterrupt  # mlx-lm's server shuts down cleanly on it


def serve(model: Path, server_args: list, load_options: Optional[dict] = None) -> None:
    """Run ``mlx_lm.server.main`` with ``--model model`` and ``server_args``; blocks.

    SIGTERM stops it like Ctrl-C does."""
    import mlx_lm.server as mlx_server

    mlx_server.load = streaming_load(load_options or {}, mlx_server.load)
    signal.signal(signal.SIGTERM, _stop)
    argv = sys.argv
    sys.argv = ["mlx_lm.server", "--model", str(model), *server_args]  # main() parses sys.argv
    try:
        mlx_server.main()
    finally:
        sys.argv = argv


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    read_config(path)  # fail here, in one line, rather than in the server's generation thread
    if not has_routed_experts(path):
        raise CheckpointError(f"{path}: no routed experts (switch_mlp tensors); nothing to stream "
                              "(serve it with mlx_lm.server)")
    server_args = ["--host", args.host, "--port", str(args.port), *args.extra]
    if args.verbose and "--log-level" not in args.extra:
        server_args += ["--log-level", "INFO"]
    say(f"Serving {path} on http://{args.host}:{args.port}/v1 (mlx-lm server, experts streamed; "
        "Ctrl-C stops)")
    serve(path, server_args, load_kwargs(args))
    # mlx-lm's server has stopped cleanly (HTTP closed, generation thread joined). Interpreter
    # shutdown would now kill its leftover daemon threads with pthread_exit, which aborts the
    # process ("terminate called without an active exception", status 134) when one of them sits
    # in MLX's C++ code; stock mlx_lm.server aborts the same way. Nothing else needs finalizing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="host to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    add_load_args(parser)
    parser.set_defaults(passthrough=True)  # unknown flags go to mlx_lm.server


def main(argv: Optional[list] = None) -> int:
    from .cli import main as cli_main

    return cli_main(["server", *(sys.argv[1:] if argv is None else argv)])
