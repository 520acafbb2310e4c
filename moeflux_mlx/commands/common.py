"""What the ``moeflux-mlx`` commands share: the load options' flags (declared once, in
``LOAD_OPTIONS``), model and sampling flags, resolving ``--model``, loading with a status line,
and running a command so that a moeflux error is one line and exit status 2.

Flags follow mlx-lm's (``--model``, ``--prompt``, ``--max-tokens``, ``--temp``, ``--top-p``,
``--seed``). Without ``--model`` the built-in demo model is used.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.generate import (
    DEFAULT_MIN_P,
    DEFAULT_MIN_TOKENS_TO_KEEP,
    DEFAULT_PREFILL_STEP_SIZE,
    DEFAULT_QUANTIZED_KV_START,
    DEFAULT_TOP_K,
    DEFAULT_XTC_PROBABILITY,
    DEFAULT_XTC_THRESHOLD,
    generation_stream,
)
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

from .. import demo_model
from ..errors import MoefluxError
from ..model.load import load
from ..model.lookup_decoding import DEFAULT_NGRAM_MAX, LookupStats
from ..model.sharded import sharded_load
from ..model.source import resolve_model_path
from ..options import (
    BACKENDS,
    BINARY_UNITS,
    EVICTIONS,
    IO_MODES,
    SI_UNITS,
    LoadOptions,
    budget_unit,
    is_auto,
    parse_budget,
)

log = logging.getLogger(__name__)

PROG = "moeflux-mlx"
DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_SEED = 0
DEMO_PROMPT = "Tell me something wise."
# doctor and info: the heading of what the machine decided (``model.runtime.machine_choices``)
MACHINE_HEADING = "decided by the machine"
MACHINE_NOTE = "not load options: chosen at load for this machine"


class UsageError(MoefluxError):
    """A command was given something it cannot use (an empty prompt, a port in use, ...): one
    line on stderr and exit status 2, like every moeflux error."""


EXIT_ERROR = 2  # a moeflux error, a bad flag or variable: one line on stderr
EXIT_INTERRUPTED = 130  # Ctrl-C
_RANK = 0  # this process's rank under mlx.launch: only rank 0 prints (errors excepted)


# --------------------------------------------------------------------------- flag value types
# Each checks one flag's value at parse time, so a bad value is argparse's one-line usage error
# (exit 2) naming the flag, never a traceback from deep inside the command.


def _budget(text: str) -> str:
    """Check a --cache-budget value at parse time, so a typo is a usage error."""
    if is_auto(text):
        return text
    try:
        parse_budget(text, 0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("cache budget ", "", 1)) from None
    return text


def lower(text: str) -> str:
    """A choice read case-insensitively (``--expert-io PREAD``)."""
    return text.strip().lower()


def int_at_least(minimum: int, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            span = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"expected a whole number {span}, got {text}")
        return value

    parse.__name__ = "int"
    return parse


def float_in(
    minimum: float, maximum: Optional[float] = None, open_minimum: bool = False
) -> Callable[[str], float]:
    """An argparse type: a number in [minimum, maximum] ((minimum, ...] with ``open_minimum``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value > minimum if open_minimum else value >= minimum
        if not (math.isfinite(value) and low_ok and (maximum is None or value <= maximum)):
            low = f"> {minimum:g}" if open_minimum else f">= {minimum:g}"
            span = low if maximum is None else f"{low} and <= {maximum:g}"
            raise argparse.ArgumentTypeError(f"expected a number {span}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


positive_int = int_at_least(1)
SEED_MAX = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer


# The options passed to ``moeflux_mlx.load``: (flag, argparse keywords). The flag's dest is the
# keyword of ``load``; an option left unset is not passed, so ``load``'s own default applies.
# A new ``load`` option is one more line here.
LOAD_OPTIONS: Tuple[Tuple[str, Dict[str, Any]], ...] = (
    (
        "--expert-io",
        dict(
            type=lower,
            choices=IO_MODES,
            help="how experts are read from disk: auto (the RAM "
            "gate: pread when they exceed 0.75 x RAM, else mmap), mmap, pread, or direct "
            "(pread bypassing the page cache: for experts many times RAM) "
            "(default: $MOEFLUX_EXPERT_IO or auto)",
        ),
    ),
    (
        "--backend",
        dict(
            type=lower,
            choices=BACKENDS,
            help="expert kernels (default: $MOEFLUX_BACKEND or "
            "auto: metal on Metal, cuda on CUDA, ops on the CPU)",
        ),
    ),
    (
        "--eviction",
        dict(
            type=str.lower,
            choices=EVICTIONS,
            help="which resident expert a miss replaces: transition (decayed use counts raised "
            "by what tends to follow the current call) or lru (least recently used, the "
            "baseline) (default: $MOEFLUX_EVICTION or transition)",
        ),
    ),
    (
        "--cache-budget",
        dict(
            type=_budget,
            metavar="SIZE",
            help="MLX memory for resident experts: a size with a unit (8GB = 8 x 1000^3 bytes, "
            "8GiB = 8 x 1024^3; also B, kB, MB, TB, KiB, MiB, TiB), a share naming its base "
            "('25%% experts' of the experts' bytes, '40%% RAM'), all, 0, or auto (the "
            "smallest budget, at most the default, forecast to decode near the default's "
            "speed: from the curve `moeflux-mlx doctor MODEL` records) (default: all "
            "experts if they fit in 40%% of RAM, else 40%% of RAM)",
        ),
    ),
    (
        "--pin-experts",
        dict(
            action=argparse.BooleanOptionalAction,
            help="CUDA, device-side table: page-lock the expert files in RAM (they must fit in "
            "0.75 x RAM) and have the GPU copy missed experts and a prefill's layers out of them "
            "(default: where they take at most half of RAM; also MOEFLUX_PIN_EXPERTS=auto|0|1)",
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
        "or Hugging Face repo); default: the built-in demo model",
    )


def add_sampling_args(
    parser: argparse.ArgumentParser, max_tokens: int = DEFAULT_MAX_TOKENS
) -> None:
    parser.add_argument(
        "--max-tokens",
        "-m",
        type=positive_int,
        default=max_tokens,
        help=f"maximum number of tokens to generate, >= 1 (default: {max_tokens})",
    )
    parser.add_argument(
        "--temp",
        type=float_in(0.0),
        default=DEFAULT_TEMP,
        help=f"sampling temperature, >= 0; 0 is greedy (default: {DEFAULT_TEMP})",
    )
    parser.add_argument(
        "--top-p",
        type=float_in(0.0, 1.0),
        default=DEFAULT_TOP_P,
        help=f"sampling top-p, in [0, 1]; 0 or 1: off (default: {DEFAULT_TOP_P})",
    )
    parser.add_argument(
        "--seed",
        type=int_at_least(0, SEED_MAX),
        default=DEFAULT_SEED,
        help=f"PRNG seed, 0 to 2^64 - 1 (default: {DEFAULT_SEED})",
    )
    parser.add_argument(
        "--min-p",
        type=float_in(0.0, 1.0),
        default=DEFAULT_MIN_P,
        help=f"sampling min-p, in [0, 1]; 0: off (default: {DEFAULT_MIN_P})",
    )
    parser.add_argument(
        "--top-k",
        type=int_at_least(0),
        default=DEFAULT_TOP_K,
        help=f"sampling top-k, >= 0; 0: off (default: {DEFAULT_TOP_K})",
    )
    parser.add_argument(
        "--min-tokens-to-keep",
        type=positive_int,
        default=DEFAULT_MIN_TOKENS_TO_KEEP,
        help=f"the fewest tokens min-p keeps (default: {DEFAULT_MIN_TOKENS_TO_KEEP})",
    )
    parser.add_argument(
        "--xtc-probability",
        type=float_in(0.0, 1.0),
        default=DEFAULT_XTC_PROBABILITY,
        help="probability of XTC sampling at each token, in [0, 1] "
        f"(default: {DEFAULT_XTC_PROBABILITY})",
    )
    parser.add_argument(
        "--xtc-threshold",
        type=float_in(0.0, 0.5),
        default=DEFAULT_XTC_THRESHOLD,
        help=f"XTC's probability threshold, in [0, 0.5] (default: {DEFAULT_XTC_THRESHOLD})",
    )


def add_lookup_args(parser: argparse.ArgumentParser) -> None:
    """``--prompt-lookup K`` and ``--ngram N``: prompt-lookup speculation (no draft model)."""
    group = parser.add_argument_group("prompt-lookup speculation")
    group.add_argument(
        "--prompt-lookup",
        type=int_at_least(0),
        default=0,
        metavar="K",
        help="draft up to K tokens a step by finding the text's last n-gram earlier in the "
        "prompt and reply, and verify them in one forward pass (the union of their experts "
        "is read once); the output is the same as without it; 0: off (default: 0)",
    )
    group.add_argument(
        "--ngram",
        type=positive_int,
        default=DEFAULT_NGRAM_MAX,
        metavar="N",
        help=f"with --prompt-lookup: the longest n-gram matched, down to 1 "
        f"(default: {DEFAULT_NGRAM_MAX})",
    )


def lookup_kwargs(args: argparse.Namespace) -> Optional[dict]:
    """``stream_lookup_generate``'s keywords for ``--prompt-lookup`` / ``--ngram`` (with a fresh
    ``LookupStats`` under ``stats``), or None when prompt lookup is off."""
    k = getattr(args, "prompt_lookup", 0)
    if not k:
        return None
    return dict(num_draft_tokens=k, ngram_max=args.ngram, ngram_min=1, stats=LookupStats())


def make_sampler(args: argparse.Namespace, tokenizer=None):
    """mlx-lm's sampler (``mlx_lm.sample_utils.make_sampler``) for the sampling flags, as
    ``mlx_lm.generate`` builds it; seeds MLX's PRNG with ``--seed``.

    Args:
        args: the parsed flags (``--temp``, ``--top-p``, ``--min-p``, ``--top-k``, ...).
        tokenizer: the model's tokenizer, for XTC's special tokens (newline and EOS).

    Returns:
        The sampler.
    """
    mx.random.seed(args.seed)
    special = []
    if tokenizer is not None:
        special = list(tokenizer.encode("\n")) + list(tokenizer.eos_token_ids)
    return mlx_make_sampler(
        args.temp,
        args.top_p,
        getattr(args, "min_p", DEFAULT_MIN_P),
        getattr(args, "min_tokens_to_keep", DEFAULT_MIN_TOKENS_TO_KEEP),
        top_k=getattr(args, "top_k", DEFAULT_TOP_K),
        xtc_probability=getattr(args, "xtc_probability", DEFAULT_XTC_PROBABILITY),
        xtc_threshold=getattr(args, "xtc_threshold", DEFAULT_XTC_THRESHOLD),
        xtc_special_tokens=special,
    )


def add_kv_args(parser: argparse.ArgumentParser, quantized: bool = True) -> None:
    """mlx-lm's KV cache and prefill flags (``--max-kv-size``, ``--prefill-step-size`` and,
    with ``quantized``, ``--kv-bits``, ``--kv-group-size``, ``--quantized-kv-start``), with
    mlx-lm's defaults."""
    group = parser.add_argument_group("KV cache and prefill (as mlx-lm)")
    group.add_argument(
        "--max-kv-size",
        type=positive_int,
        default=None,
        help="the most tokens the KV cache keeps (a rotating cache); default: no limit",
    )
    group.add_argument(
        "--prefill-step-size",
        type=positive_int,
        default=None,
        help="prompt tokens processed at a time; smaller lowers peak memory during prefill "
        f"(default: the model's choice: {DEFAULT_PREFILL_STEP_SIZE}, as mlx-lm, where every "
        "expert is resident; larger where experts stream, so a prompt reads them fewer times)",
    )
    if not quantized:
        return
    group.add_argument(
        "--kv-bits",
        type=int_at_least(1, 8),
        default=None,
        help="bits of a quantized KV cache (default: not quantized)",
    )
    group.add_argument(
        "--kv-group-size", type=positive_int, default=64, help="KV quantization group size"
    )
    group.add_argument(
        "--quantized-kv-start",
        type=int_at_least(0),
        default=DEFAULT_QUANTIZED_KV_START,
        help="with --kv-bits: quantize the KV cache from this many tokens on "
        f"(default: {DEFAULT_QUANTIZED_KV_START})",
    )


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """``--trust-remote-code``, as mlx-lm's commands take it."""
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="trust the model's own tokenizer code (Hugging Face's trust_remote_code)",
    )


def take_prefill_step(args: argparse.Namespace, model) -> None:
    """``--prefill-step-size`` left unset becomes the loaded model's own choice
    (``model.moeflux.prefill_step_size``; mlx-lm's 2048 for a model without streamed experts)."""
    if getattr(args, "prefill_step_size", 0) is None:
        runtime = getattr(model, "moeflux", None)
        args.prefill_step_size = (
            runtime.prefill_step_size if runtime is not None else DEFAULT_PREFILL_STEP_SIZE
        )


def kv_kwargs(args: argparse.Namespace) -> dict:
    """``stream_generate``'s prefill and KV-cache keywords for the flags ``add_kv_args`` adds
    (those a command lacks are left out, so mlx-lm's defaults apply)."""
    names = ("prefill_step_size", "kv_bits", "kv_group_size", "quantized_kv_start")
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


PROGRESS_MIN_TOKENS = 2048  # a prompt this long or longer shows its prefill's progress


def prefill_progress(
    total_at_least: int = PROGRESS_MIN_TOKENS, out=None
) -> Callable[[int, int], None]:
    """A ``prompt_progress_callback`` for mlx-lm's ``stream_generate``: for a prompt of at
    least ``total_at_least`` tokens, one line on stderr per prefill step
    (``prompt: 2048/8000 tokens (25.6%, 412.3 tok/s)``); shorter prompts print nothing.

    Args:
        total_at_least: the shortest prompt shown.
        out: where to write (default: stderr; rank 0 only under mlx.launch).

    Returns:
        The callback, taking (tokens processed, prompt tokens).
    """
    t0 = time.perf_counter()

    def show(done: int, total: int) -> None:
        if total < total_at_least or _RANK != 0 or (done == 0 and total > 0):
            return
        rate = done / max(time.perf_counter() - t0, 1e-9)
        line = f"prompt: {done}/{total} tokens ({100 * done / total:.1f}%, {rate:.1f} tok/s)"
        print(line, file=out or sys.stderr, flush=True)

    return show


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """``--pipeline``, as mlx-lm's commands take it; it counts under ``mlx.launch`` only."""
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch: give each process a range of layers (pipeline) instead of a "
        "part of every layer (tensor parallelism); each reads only its share of the experts",
    )


def distributed() -> Optional[mx.distributed.Group]:
    """MLX's group when ``mlx.launch`` started this process with others, else None.

    Every process but rank 0 is silenced from here on: its standard output goes nowhere, and
    its status lines and warnings are not shown; its errors are, marked with its rank.

    Returns:
        The group (size > 1), or None for a process on its own.
    """
    global _RANK
    group = mx.distributed.init()
    if group.size() < 2:
        return None
    _RANK = group.rank()
    if _RANK:
        sys.stdout = open(os.devnull, "w")  # for the rest of the process
        logging.disable(logging.WARNING)
    return group


def gather_text(text: str, group: Optional[mx.distributed.Group]) -> List[str]:
    """Every process's ``text``, in rank order (``[text]`` without a group). A collective:
    every process of ``group`` must call it, in the same order."""
    if group is None:
        return [text]
    # the model's last steps (and their collectives) may still run on mlx-lm's stream: they
    # finish first, so that every process's collectives come in the same order
    mx.synchronize(generation_stream)
    data = np.frombuffer(text.encode(), np.uint8)
    # on the group's own stream: the CPU's, but the GPU's under NCCL, which has no CPU path
    sizes = np.array(mx.distributed.all_gather(mx.array([data.size]), group=group))
    padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
    padded[: data.size] = data
    rows = np.array(mx.distributed.all_gather(mx.array(padded[None]), group=group))
    return [bytes(rows[r, : sizes[r]]).decode() for r in range(group.size())]


def per_rank(texts: List[str]) -> str:
    """``texts`` of every process: as is for one, else ``rank 0: ...; rank 1: ...``."""
    return texts[0] if len(texts) == 1 else "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts))


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
    """A status line for the person at the terminal (stderr: stdout carries the output); rank
    0's only, under mlx.launch."""
    if _RANK == 0:
        print(message, file=sys.stderr, flush=True)


def fmt_bytes(n: float, unit: Optional[str] = None) -> str:
    """``n`` bytes for people: in SI units (``28.31 MB``), or in ``unit`` (``"GiB"``, ``"MB"``:
    the unit a user typed, so that ``--cache-budget 8MiB`` is shown as ``8 MiB``)."""
    if unit is not None:
        scale = {**SI_UNITS, **BINARY_UNITS}[unit.lower()]
        return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    for u in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or u == "GB":
            return f"{n:.0f} {u}" if u == "B" else f"{n:.2f} {u}"
        n /= 1000
    raise AssertionError


def resolve_model(model: Optional[str]) -> Path:
    """The directory for ``--model``: the built-in demo model for None, else a directory or a
    repo id as ``moeflux_mlx.load`` resolves it (``model.source``)."""
    if model is None:
        path = demo_model.checkpoint_path()
        say(
            "No --model given: using the built-in demo model (a small qwen3_moe trained for "
            f"moeflux-mlx, 64 experts a layer, 4-bit) in {path}"
        )
        return path
    return resolve_model_path(model)


def load_model(
    args: argparse.Namespace,
    path: Optional[Path] = None,
    group: Optional[mx.distributed.Group] = None,
    tokenizer_config: Optional[dict] = None,
):
    """``moeflux_mlx.load`` with the command's options, or with a ``group`` (``distributed()``)
    ``moeflux_mlx.sharded_load``: a pipeline with ``--pipeline``, else tensor parallelism.
    Prints what was loaded (under mlx.launch: each process's share). ``tokenizer_config`` as
    for ``mlx_lm.load``; ``--trust-remote-code`` is added to it."""
    tokenizer_config = dict(tokenizer_config or {})
    if getattr(args, "trust_remote_code", False):
        tokenizer_config["trust_remote_code"] = True
    options = load_options(args)  # a bad MOEFLUX_* variable fails before anything is read
    path = resolve_model(args.model) if path is None else path
    t0 = time.perf_counter()
    if group is None:
        say(f"Loading {path} ...")
        model, tokenizer = load(path, options=options, tokenizer_config=tokenizer_config)
        split = ""
    else:
        pipeline = getattr(args, "pipeline", False)
        split = f" ({'pipeline' if pipeline else 'tensor parallel'} over {group.size()} processes)"
        say(f"Loading {path}{split} ...")
        model, tokenizer = sharded_load(
            path,
            pipeline_group=group if pipeline else None,
            tensor_group=None if pipeline else group,
            options=options,
            tokenizer_config=tokenizer_config,
        )
    rt = model.moeflux
    # the backend as the runtime reports it: what computes the experts, not what was asked for
    info = rt.stats_dict()
    budget = rt.options.cache_budget
    cache = info.get("cache", "?")
    total = rt.layout.total_expert_bytes
    if is_auto(budget):  # what auto chose, and why
        cache += f", budget {fmt_bytes(rt.budget.bytes)} ({rt.budget.why})"
    elif budget is not None:  # shown in the units it was given in
        cache += f", budget {fmt_budget(budget, total)}"
    n = len(rt.layout.layers)
    layers = gather_text(f"{n} MoE layer{'s' * (n != 1)}, {fmt_bytes(total)}", group)
    say(
        f"Loaded in {time.perf_counter() - t0:.1f} s{split}: {per_rank(layers)} of experts "
        f"streamed from disk (expert I/O: {info['io_mode']}, cache: {cache}, "
        f"backend: {info['backend']})."
    )
    return model, tokenizer


def fmt_budget(budget, total_expert_bytes: int) -> str:
    """A cache budget for people, in the units it was written in (``8 GiB``); a share or
    ``all`` as bytes and what they are (``10.11 GB (40% RAM)``)."""
    n = parse_budget(budget, total_expert_bytes)
    unit = budget_unit(budget)
    if unit is not None:
        return fmt_bytes(n, unit)
    if isinstance(budget, str) and n:  # "all", "25% experts", "40% RAM"
        return f"{fmt_bytes(n)} ({' '.join(budget.split())})"
    return fmt_bytes(n)


def setup_logging(verbose: bool, configure_root: bool = True) -> None:
    """Warnings always; ``--verbose``: moeflux_mlx's INFO lines too (not other libraries')."""
    if configure_root:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    if verbose:
        logging.getLogger("moeflux_mlx").setLevel(logging.INFO)


def error(message: str) -> int:
    """Print ``moeflux-mlx: error: MESSAGE`` (one line, stderr; under mlx.launch, rank N > 0
    says ``(rank N)``); return the error exit status."""
    rank = f"(rank {_RANK}) " if _RANK else ""
    print(f"{PROG}: error: {rank}{' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def run_command(func, args: argparse.Namespace) -> int:
    """Run one command. A moeflux error (and a bad ``MOEFLUX_*`` variable) is one line on stderr
    and exit status 2; Ctrl-C is exit 130; a closed stdout (``| head``) ends quietly. Anything
    else is a bug, still reported in one line (``--verbose`` adds the traceback)."""
    verbose = getattr(args, "verbose", False)
    setup_logging(verbose, configure_root=not getattr(args, "passthrough", False))
    try:
        return int(func(args) or 0)
    except MoefluxError as e:
        return error(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        say("Interrupted.")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of stdout went away: nothing more to say, and Python must not try to
        # flush the closed pipe again at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:  # e.g. an output file that cannot be written
        if verbose:
            log.exception("%s failed", PROG)
        return error(_os_error(e))
    except Exception as e:  # noqa: BLE001 - the last resort: a bug, but still one line
        if verbose:
            log.exception("unexpected error")
        hint = "" if verbose else " (--verbose shows the traceback)"
        return error(f"unexpected {type(e).__name__}: {e}{hint}; please report it")


def _os_error(e: OSError) -> str:
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}"


def read_prompt(text: str) -> str:
    """``--prompt``: ``\\n`` and ``\\t`` escapes as mlx-lm reads them; ``-`` reads stdin, without
    the trailing newline that ``echo`` and editors add."""
    if text == "-":
        try:
            text = sys.stdin.read()
            text.encode("utf-8")  # undecodable bytes come as surrogates in a C locale
        except (UnicodeDecodeError, UnicodeEncodeError) as e:
            raise UsageError(f"--prompt -: standard input is not text ({e.reason})") from None
        return text.rstrip("\r\n")
    return text.replace("\\n", "\n").replace("\\t", "\t")


def prompt_tokens(
    tokenizer, prompt: str, system_prompt: Optional[str] = None, use_chat_template: bool = True
) -> list:
    """Token ids of ``prompt``, through the chat template when the tokenizer has one."""
    if use_chat_template and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        tokens = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    else:
        tokens = list(tokenizer.encode(prompt))
    if not tokens:
        raise UsageError("the prompt is empty: the model needs at least one token to start from")
    return tokens


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


def stats_line(
    last,
    runtime=None,
    reused: Optional[int] = None,
    group: Optional[mx.distributed.Group] = None,
    draft: Optional[LookupStats] = None,
) -> str:
    """``[prompt: ... | reply: ... | peak memory ... | experts: ... | draft tokens: ...]`` for
    one reply; with a ``group``, each process's experts (a collective: every process calls it);
    with ``draft`` (prompt lookup), the draft tokens proposed and accepted."""
    experts = None if runtime is None else expert_summary(runtime.stats_dict())
    if experts is not None:
        experts = per_rank(gather_text(experts, group))
    if last is None:
        return "[no tokens generated]"
    cached = f" ({reused} cached)" if reused is not None else ""
    parts = [
        f"prompt: {last.prompt_tokens} tokens{cached}, {last.prompt_tps:.1f} tok/s",
        f"reply: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s",
        f"peak memory {fmt_bytes(last.peak_memory * 1e9)}",
    ]
    if experts is not None:
        parts.append("experts: " + experts)
    if draft is not None:
        parts.append(draft.summary())
    return "[" + " | ".join(parts) + "]"


def expert_summary(stats: dict) -> str:
    """``28.31 MB read, hit rate 12.5% (pread)`` from ``model.moeflux.stats_dict()``; with
    calls that found every expert of their layer resident, ``28.31 MB read, hit rate 95.1%,
    96 of 104 layer calls all resident (mmap)``.

    The hit rate counts every expert routed: each selection of a call to a fully resident layer
    is a hit, and the first call of such a layer, which reads it whole, counts its experts as
    misses (``counters.Stats.hit_rate``).

    Args:
        stats: ``model.moeflux.stats_dict()``.

    Returns:
        The summary, one line.
    """
    t = stats["total"]
    io = stats.get("io_mode", "?")
    calls, resident = t.get("calls", 0), t.get("resident_calls", 0)
    head = f"{fmt_bytes(t['bytes_read'])} read"
    if t.get("hit_rate") is None:  # no call counted an expert
        return f"{head} ({io})"
    hit = f"hit rate {100 * t['hit_rate']:.1f}%"
    if resident:
        return f"{head}, {hit}, {resident} of {calls} layer calls all resident ({io})"
    return f"{head}, {hit} ({io})"


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
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(join_dash_values(parser, argv))
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return run_command(run, args)


def _value_flags(parser: argparse.ArgumentParser, out: Optional[set] = None) -> set:
    """The option strings of ``parser`` and its subcommands' parsers, and which take one value."""
    out = set() if out is None else out
    for action in parser._actions:  # argparse keeps no public list of them
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _value_flags(sub, out)
        elif action.option_strings and action.nargs is None:
            out.update((flag, True) for flag in action.option_strings)
        else:
            out.update((flag, False) for flag in action.option_strings)
    return out


def join_dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> List[str]:
    """``--flag -VALUE`` as ``--flag=-VALUE`` for a flag that takes one value and a value that
    is not itself a flag: argparse reads ``--cache-budget -5GB`` as two flags and answers
    "expected one argument"; joined, the value reaches the flag's own check ("is negative")."""
    flags = _value_flags(parser)
    takes_value = {flag for flag, value in flags if value}
    known = {flag for flag, _ in flags}
    out: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (
            arg in takes_value
            and nxt is not None
            and nxt.startswith("-")
            and nxt != "-"
            and nxt.split("=", 1)[0] not in known
        ):
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out
