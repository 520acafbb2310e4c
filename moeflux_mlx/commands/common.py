"""What the ``moeflux-mlx`` commands share: the load options' flags (declared once, in
``LOAD_OPTIONS``), model and sampling flags, resolving ``--model``, loading with a status line,
and running a command so that a moeflux error is one line and exit status 2.

Flags follow mlx-lm's (``--model``, ``--prompt``, ``--max-tokens``, ``--temp``, ``--top-p``,
``--seed``). Without ``--model`` the demo checkpoint is used.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler
from mlx_lm.utils import _download

from ..errors import CheckpointError, MoefluxError
from ..model.load import load
from ..options import BACKENDS, IO_MODES, LoadOptions, parse_budget
from ..testing.synth import demo_checkpoint

log = logging.getLogger(__name__)

PROG = "moeflux-mlx"
DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_SEED = 0
DEMO_PROMPT = "Hello! How are you today?"


def _budget(text: str) -> str:
    """Check a --cache-budget value at parse time, so a typo is a usage error."""
    try:
        parse_budget(text, 0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


# The options passed to ``moeflux_mlx.load``: (flag, argparse keywords). The flag's dest is the
# keyword of ``load``; an option left unset is not passed, so ``load``'s own default applies.
# A new ``load`` option is one more line here.
LOAD_OPTIONS = (
    (
        "--expert-io",
        dict(
            choices=IO_MODES,
            help="how experts are read from disk: auto (the RAM "
            "gate: pread when they exceed 0.75 x RAM, else mmap), mmap or pread "
            "(default: $MOEFLUX_EXPERT_IO or auto)",
        ),
    ),
    (
        "--backend",
        dict(
            choices=BACKENDS,
            help="expert kernels (default: $MOEFLUX_BACKEND or "
            "auto: metal on Metal, cuda on CUDA, ops on the CPU)",
        ),
    ),
    (
        "--threads",
        dict(type=int, metavar="N", help="parallel expert reads in pread mode (default: 8)"),
    ),
    (
        "--cache-budget",
        dict(
            type=_budget,
            metavar="SIZE",
            help="MLX memory for "
            "resident experts: 8GB, 512MiB, a fraction of RAM (0.25), all, or 0 "
            "(default: all experts if they fit in 0.4 x RAM)",
        ),
    ),
    (
        "--prefetch",
        dict(
            action="store_const",
            const=True,
            help="read the experts the next layer's router predicts in the background",
        ),
    ),
    (
        "--device-table",
        dict(
            action=argparse.BooleanOptionalAction,
            help="CUDA: decode looks "
            "expert slots up on the GPU, with no host sync per layer (default: "
            "on where CUDA is; also MOEFLUX_DEVICE_TABLE=0|1)",
        ),
    ),
)


# --------------------------------------------------------------------------- shared options


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_load_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("streaming options (moeflux_mlx.load)")
    for flag, kwargs in LOAD_OPTIONS:
        group.add_argument(flag, default=None, **kwargs)


def load_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``moeflux_mlx.load`` that were given on the command line."""
    out = {}
    for flag, _ in LOAD_OPTIONS:
        value = getattr(args, _dest(flag), None)
        if value is not None:
            out[_dest(flag)] = value
    return out


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=str,
        default=None,
        help="a converted directory or a plain mlx-lm MoE checkpoint (local path "
        "or Hugging Face repo); default: the demo checkpoint, built once",
    )


def add_sampling_args(
    parser: argparse.ArgumentParser, max_tokens: int = DEFAULT_MAX_TOKENS
) -> None:
    parser.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=max_tokens,
        help=f"maximum number of tokens to generate (default: {max_tokens})",
    )
    parser.add_argument(
        "--temp",
        type=float,
        default=DEFAULT_TEMP,
        help=f"sampling temperature (default: {DEFAULT_TEMP})",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=DEFAULT_TOP_P,
        help=f"sampling top-p (default: {DEFAULT_TOP_P})",
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help=f"PRNG seed (default: {DEFAULT_SEED})"
    )


def make_sampler(args: argparse.Namespace):
    """mlx-lm's sampler for ``--temp`` / ``--top-p``; seeds MLX's PRNG with ``--seed``."""
    mx.random.seed(args.seed)
    return mlx_make_sampler(args.temp, args.top_p)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="log what moeflux_mlx does (INFO), e.g. the RAM gate's decision",
    )


# --------------------------------------------------------------------------- helpers


def device_name() -> str:
    return "cpu" if mx.default_device() == mx.cpu else "gpu"


def say(message: str) -> None:
    """A status line for the person at the terminal (stderr: stdout carries the output)."""
    print(message, file=sys.stderr, flush=True)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


_HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(model: Optional[str]) -> Path:
    """The directory for ``--model``: the demo checkpoint for None, a download for a repo id."""
    if model is None:
        say(
            "No --model given: using the demo checkpoint (random-weight qwen3_moe, built once "
            "and cached; its text is gibberish)."
        )
        synth_log = logging.getLogger("moeflux_mlx.testing.synth")
        level = synth_log.level
        synth_log.setLevel(logging.INFO)  # its "Building ..." lines are the progress of a build
        try:
            path = demo_checkpoint()
        finally:
            synth_log.setLevel(level)
        say(f"Demo checkpoint: {path}")
        return path
    path = Path(model).expanduser()
    if path.exists() or not _HUB_REPO.fullmatch(model):
        return path
    try:
        return _download(model)
    except Exception as e:  # the hub client raises many types; all mean "could not get it"
        raise CheckpointError(
            f"{model}: not a local directory, and fetching it from the "
            f"Hugging Face Hub failed ({type(e).__name__}: {e})"
        ) from e


def load_model(args: argparse.Namespace, path: Optional[Path] = None):
    """``moeflux_mlx.load`` with the command's options; prints what was loaded."""
    path = resolve_model(args.model) if path is None else path
    say(f"Loading {path} ...")
    t0 = time.perf_counter()
    model, tokenizer = load(path, **load_kwargs(args))
    rt = model.moeflux
    info = rt.stats_dict()
    say(
        f"Loaded in {time.perf_counter() - t0:.1f} s: {len(rt.layout.layers)} MoE layers, "
        f"{fmt_bytes(rt.layout.total_expert_bytes)} of experts streamed from disk "
        f"(expert I/O: {info['io_mode']}, cache: {info.get('cache', '?')}, "
        f"backend: {info['backend']})."
    )
    return model, tokenizer


def setup_logging(verbose: bool, configure_root: bool = True) -> None:
    """Warnings always; ``--verbose``: moeflux_mlx's INFO lines too (not other libraries')."""
    if configure_root:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    if verbose:
        logging.getLogger("moeflux_mlx").setLevel(logging.INFO)


def run_command(func, args: argparse.Namespace) -> int:
    """Run one command; moeflux errors become one line on stderr and exit code 2."""
    setup_logging(args.verbose, configure_root=not getattr(args, "passthrough", False))
    try:
        return int(func(args) or 0)
    except MoefluxError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def prompt_tokens(
    tokenizer, prompt: str, system_prompt: Optional[str] = None, use_chat_template: bool = True
) -> list:
    """Token ids of ``prompt``, through the chat template when the tokenizer has one."""
    if use_chat_template and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tokenizer.encode(prompt)


def print_stream(responses: Iterable, out=None):
    """Print each token's text as it comes; return the last response."""
    out = out or sys.stdout
    last = None
    for last in responses:
        out.write(last.text)
        out.flush()
    out.write("\n")
    out.flush()
    return last


def stats_line(last, runtime=None, reused: Optional[int] = None) -> str:
    """``[prompt: ... | reply: ... | peak memory ... | experts: ...]`` for one reply."""
    if last is None:
        return "[no tokens generated]"
    cached = f" ({reused} cached)" if reused is not None else ""
    parts = [
        f"prompt: {last.prompt_tokens} tokens{cached}, {last.prompt_tps:.1f} tok/s",
        f"reply: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s",
        f"peak memory {fmt_bytes(last.peak_memory * 1e9)}",
    ]
    if runtime is not None:
        s = runtime.stats_dict()
        t = s["total"]
        # no routed experts counted: every call found its experts resident without asking
        hit = f"{100 * t['hit_rate']:.1f}%" if t.get("experts_routed", 1) else "n/a"
        parts.append(
            f"experts: {fmt_bytes(t['bytes_read'])} read, hit rate {hit} ({s.get('io_mode', '?')})"
        )
    return "[" + " | ".join(parts) + "]"


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The command line's load options, resolved once (flags, then ``MOEFLUX_*``, then defaults)."""
    return LoadOptions.resolve(**load_kwargs(args))


def command_parser(
    name: str, help: str, add_args: Callable[[argparse.ArgumentParser], None], **kwargs
) -> argparse.ArgumentParser:
    """A parser for one command run on its own (``python -m moeflux_mlx.commands.NAME``)."""
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", description=help, **kwargs)
    add_common_args(parser)
    add_args(parser)
    return parser


def main_for(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], int],
    argv: Optional[list] = None,
) -> int:
    """Parse ``argv`` with ``parser`` and run the command (see ``run_command``); flags the parser
    does not know are an error unless the command passes them through (``passthrough``)."""
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return run_command(run, args)
