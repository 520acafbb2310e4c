"""The ``moeflux-mlx`` command.

    moeflux-mlx generate  one-shot generation (like ``mlx_lm.generate``)
    moeflux-mlx chat      interactive multi-turn chat (``moeflux_mlx.chat``)
    moeflux-mlx convert   convert an mlx-lm checkpoint into a streaming directory
    moeflux-mlx info      what streams, how big it is, and how it would be read
    moeflux-mlx compare   stock mlx-lm vs moeflux-mlx on the same prompts (``moeflux_mlx.compare``)
    moeflux-mlx demo      build the small demo model if needed and generate on it
    moeflux-mlx server    mlx-lm's OpenAI-compatible server, experts streamed (moeflux_mlx.server)

Flags follow mlx-lm's (``--model``, ``--prompt``, ``--max-tokens``, ``--temp``, ``--top-p``,
``--seed``). The options of ``moeflux_mlx.load`` are declared once, in ``LOAD_OPTIONS``, and every
command that loads a model takes them. Without ``--model`` the demo checkpoint is used.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from pathlib import Path
from typing import Optional

from .backends import BACKENDS
from .errors import CheckpointError, MoefluxError
from .store import IO_MODES

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
    from .cache import parse_budget

    try:
        parse_budget(text, 0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


# The options passed to ``moeflux_mlx.load``: (flag, argparse keywords). The flag's dest is the
# keyword of ``load``; an option left unset is not passed, so ``load``'s own default applies.
# A new ``load`` option is one more line here.
LOAD_OPTIONS = (
    ("--expert-io", dict(choices=IO_MODES, help="how experts are read from disk: auto (the RAM "
                         "gate: pread when they exceed 0.75 x RAM, else mmap), mmap or pread "
                         "(default: $MOEFLUX_EXPERT_IO or auto)")),
    ("--backend", dict(choices=BACKENDS, help="expert kernels (default: $MOEFLUX_BACKEND or "
                       "auto: metal on Metal, cuda on CUDA, ops on the CPU)")),
    ("--threads", dict(type=int, metavar="N", help="parallel expert reads in pread mode "
                       "(default: 8)")),
    ("--cache-budget", dict(type=_budget, metavar="SIZE", help="MLX memory for "
                            "resident experts: 8GB, 512MiB, a fraction of RAM (0.25), all, or 0 "
                            "(default: all experts if they fit in 0.4 x RAM)")),
    ("--prefetch", dict(action="store_const", const=True, help="read the experts the next "
                        "layer's router predicts in the background")),
    ("--device-table", dict(action=argparse.BooleanOptionalAction, help="CUDA: decode looks "
                            "expert slots up on the GPU, with no host sync per layer (default: "
                            "on where CUDA is; also MOEFLUX_DEVICE_TABLE=0|1)")),
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
    parser.add_argument("--model", type=str, default=None,
                        help="a converted directory or a plain mlx-lm MoE checkpoint (local path "
                             "or Hugging Face repo); default: the demo checkpoint, built once")


def add_sampling_args(parser: argparse.ArgumentParser,
                      max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
    parser.add_argument("--max-tokens", "-m", type=int, default=max_tokens,
                        help=f"maximum number of tokens to generate (default: {max_tokens})")
    parser.add_argument("--temp", type=float, default=DEFAULT_TEMP,
                        help=f"sampling temperature (default: {DEFAULT_TEMP})")
    parser.add_argument("--top-p", type=float, default=DEFAULT_TOP_P,
                        help=f"sampling top-p (default: {DEFAULT_TOP_P})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"PRNG seed (default: {DEFAULT_SEED})")


def make_sampler(args: argparse.Namespace):
    """mlx-lm's sampler for ``--temp`` / ``--top-p``; seeds MLX's PRNG with ``--seed``."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    mx.random.seed(args.seed)
    return mlx_make_sampler(args.temp, args.top_p)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="log what moeflux_mlx does (INFO), e.g. the RAM gate's decision")


# --------------------------------------------------------------------------- helpers


def device_name() -> str:
    import mlx.core as mx

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
        from .synth import demo_checkpoint

        say("No --model given: using the demo checkpoint (random-weight qwen3_moe, built once "
            "and cached; its text is gibberish).")
        synth_log = logging.getLogger("moeflux_mlx.synth")
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
    from mlx_lm.utils import _download

    try:
        return _download(model)
    except Exception as e:  # the hub client raises many types; all mean "could not get it"
        raise CheckpointError(f"{model}: not a local directory, and fetching it from the "
                              f"Hugging Face Hub failed ({type(e).__name__}: {e})") from e


def load_model(args: argparse.Namespace, path: Optional[Path] = None):
    """``moeflux_mlx.load`` with the command's options; prints what was loaded."""
    from .loader import load

    path = resolve_model(args.model) if path is None else path
    say(f"Loading {path} ...")
    t0 = time.perf_counter()
    model, tokenizer = load(path, **load_kwargs(args))
    rt = model.moeflux
    info = rt.stats_dict()
    say(f"Loaded in {time.perf_counter() - t0:.1f} s: {len(rt.layout.layers)} MoE layers, "
        f"{fmt_bytes(rt.layout.total_expert_bytes)} of experts streamed from disk "
        f"(expert I/O: {info['io_mode']}, cache: {info.get('cache', '?')}, "
        f"backend: {info['backend']}).")
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


# --------------------------------------------------------------------------- generate


def prompt_tokens(tokenizer, prompt: str, system_prompt: Optional[str] = None,
                  use_chat_template: bool = True) -> list:
    """Token ids of ``prompt``, through the chat template when the tokenizer has one."""
    if use_chat_template and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tokenizer.encode(prompt)


def _generate(args: argparse.Namespace) -> int:
    from mlx_lm import stream_generate

    from .chat import print_stream, stats_line

    model, tokenizer = load_model(args)
    try:
        prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
        prompt = sys.stdin.read() if prompt == "-" else prompt
        tokens = prompt_tokens(tokenizer, prompt, args.system_prompt,
                               not args.ignore_chat_template)
        model.moeflux.reset_stats()
        last = print_stream(stream_generate(model, tokenizer, tokens, max_tokens=args.max_tokens,
                                            sampler=make_sampler(args)))
        say(stats_line(last, model.moeflux))
    finally:
        model.moeflux.close()
    return 0


def _add_generate_args(p: argparse.ArgumentParser, prompt: str = DEFAULT_PROMPT,
                       max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
    add_model_arg(p)
    p.add_argument("--prompt", "-p", default=prompt,
                   help=f"the message ('-' reads stdin; default: {prompt!r})")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt without the tokenizer's chat template")
    add_sampling_args(p, max_tokens)
    add_load_args(p)


# --------------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    args.model = None
    rc = _generate(args)
    say("This was the random-weight demo model: the pipeline ran, the words mean nothing. Next: "
        f"`{PROG} chat`, `{PROG} info MODEL`, `{PROG} generate --model MODEL --prompt ...`.")
    return rc


# --------------------------------------------------------------------------- convert


def _convert(args: argparse.Namespace) -> int:
    from .convert import convert

    from .checkpoint import packed_layout

    t0 = time.perf_counter()
    existed = Path(args.dst).exists()  # convert() accepts a finished conversion of the same SRC
    dst = convert(args.src, args.dst, verify=args.verify, progress=not args.quiet)
    layout = packed_layout(dst)
    done = "Already converted" if existed else "Converted"
    print(f"{done} {args.src} -> {dst} in {time.perf_counter() - t0:.1f} s: "
          f"{len(layout.layers)} MoE layers, {fmt_bytes(layout.total_expert_bytes)} of experts"
          + (" (verified byte for byte)" if args.verify else ""))
    return 0


# --------------------------------------------------------------------------- info


def describe(path: Path, backend: Optional[str] = None, expert_io: Optional[str] = None,
             cache_budget: Optional[str] = None) -> list:
    """``(label, value)`` rows saying what would stream from ``path`` and how."""
    import os

    import psutil

    from .checkpoint import is_packed, packed_layout, read_config, scan_checkpoint
    from .safetensors_index import index_directory
    from .store import RAM_FRACTION, select_expert_io

    path = Path(path)
    config = read_config(path)
    text = config.get("text_config", config)
    packed = is_packed(path)
    if packed:
        layout = packed_layout(path)
        dense = sum(r.nbytes for r in index_directory(path).values())
    else:
        ckpt = scan_checkpoint(path)
        layout, dense = ckpt.layout, sum(r.nbytes for r in ckpt.dense.values())
    layers = sorted(layout.layers)
    lay = [layout.layers[i] for i in layers]

    def one_or_all(values):
        values = sorted(set(values))
        return str(values[0]) if len(values) == 1 else ", ".join(map(str, values))

    def quant(q):
        return "none (unquantized)" if q is None else f"{q.bits}-bit {q.mode}, group {q.group_size}"

    total = layout.total_expert_bytes
    ram = psutil.virtual_memory()
    mode = select_expert_io(total, expert_io)
    env = os.environ.get("MOEFLUX_EXPERT_IO")
    if expert_io or env:
        why = (f"requested: --expert-io {expert_io}" if expert_io
               else f"requested: MOEFLUX_EXPERT_IO={env}")
    else:
        cmp = ">" if total > RAM_FRACTION * ram.total else "<="
        why = (f"auto: experts {fmt_bytes(total)} {cmp} {RAM_FRACTION} x RAM "
               f"{fmt_bytes(ram.total)} = {fmt_bytes(RAM_FRACTION * ram.total)}")
    try:
        from .cache import parse_budget

        budget = parse_budget(cache_budget, total)
        cache = (f"{fmt_bytes(min(budget, total))} of MLX memory for resident experts "
                 f"({100 * min(budget, total) / max(total, 1):.0f}% of them; "
                 f"{'--cache-budget' if cache_budget is not None else 'default'})")
    except (ImportError, ValueError) as e:
        cache = f"? ({e})"
    try:
        from .backends import select_backend

        picked = select_backend(backend).name
    except Exception as e:  # e.g. kernels missing on this build: say so, info still useful
        picked = f"unavailable ({type(e).__name__}: {e})"

    return [
        ("model", str(path)),
        ("model_type", f"{config.get('model_type')}"
                       + (f" (text: {text.get('model_type')})" if text is not config else "")),
        ("format", "converted (packed_experts/, one file per MoE layer)" if packed
         else "mlx-lm checkpoint (experts read from the safetensors; `convert` packs them)"),
        ("layers", f"{text.get('num_hidden_layers', '?')}, of which {len(layers)} MoE "
                   f"({_ranges(layers)})"),
        ("experts per layer", one_or_all(l.num_experts for l in lay)),
        ("top-k", str(text.get("num_experts_per_tok", "?"))),
        ("expert quantization", one_or_all(quant(l.quantization) for l in lay)),
        ("expert blob", one_or_all(f"{l.blob_size:,} bytes" for l in lay)),
        ("experts, total", f"{fmt_bytes(total)} ({total:,} bytes)"),
        ("dense weights", fmt_bytes(dense)),
        ("RAM", f"{fmt_bytes(ram.total)} total, {fmt_bytes(ram.available)} available"),
        ("expert I/O", f"{mode} ({why})"),
        ("expert cache", cache),
        ("backend", f"{picked} ({backend or os.environ.get('MOEFLUX_BACKEND') or 'auto'}, "
                    f"device {device_name()})"),
    ]


def _ranges(ids: list) -> str:
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def _info(args: argparse.Namespace) -> int:
    path = resolve_model(args.model_path)
    rows = describe(path, args.backend, args.expert_io, args.cache_budget)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, bench, chat, compare, server

    parser = argparse.ArgumentParser(
        prog=PROG, description="Streaming-experts MoE inference for MLX: run MoE models whose "
                               "experts exceed memory inside mlx-lm.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, func, help, **kwargs):
        p = sub.add_parser(name, help=help, description=help, **kwargs)
        add_common_args(p)
        p.set_defaults(func=func)
        return p

    _add_generate_args(command("generate", _generate, "generate a reply to one prompt"))
    chat.add_args(command("chat", chat.run, "chat in the terminal (multi-turn, streamed)"))

    p = command("convert", _convert, "convert an mlx-lm checkpoint into a streaming directory "
                "(experts packed one file per MoE layer)")
    p.add_argument("src", metavar="SRC", help="mlx-lm checkpoint directory")
    p.add_argument("dst", metavar="DST", help="new directory to write")
    p.add_argument("--verify", action="store_true",
                   help="re-read everything written and compare it with SRC byte for byte")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")

    p = command("info", _info, "describe a model: MoE layers, experts, sizes, how experts "
                "would be read (RAM gate) and which kernels")
    p.add_argument("model_path", metavar="MODEL", nargs="?", default=None,
                   help="converted directory or mlx-lm checkpoint (default: the demo checkpoint)")
    add_load_args(p)

    compare.add_args(command("compare", compare.run, "run the same prompts greedily with stock "
                             "mlx-lm and with moeflux-mlx; compare tokens, log-probs and speed"))

    p = command("demo", _demo, "build the small demo model (once) and generate on it")
    p.add_argument("--prompt", "-p", default=DEMO_PROMPT, help=f"default: {DEMO_PROMPT!r}")
    p.add_argument("--system-prompt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ignore-chat-template", action="store_true", help=argparse.SUPPRESS)
    add_sampling_args(p, max_tokens=48)
    add_load_args(p)

    server.add_args(command("server", server.run, "serve a streaming model through mlx-lm's "
                            "OpenAI-compatible HTTP server",
                            epilog=server.EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter))
    bench.add_args(command("bench", lambda a: bench.run_cli(a), "decode benchmark: stock mlx-lm "
                           "and moeflux-mlx at several cache budgets, both I/O modes, prefetch "
                           "off/on; writes JSON, markdown and a plot"))
    return parser


def main(argv: Optional[list] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return run_command(args.func, args)


if __name__ == "__main__":
    # ``python -m moeflux_mlx.cli``: run the package's copy of this module, the one that
    # chat/compare/server import, rather than a second copy living in __main__.
    from moeflux_mlx.cli import main as _main

    sys.exit(_main())
