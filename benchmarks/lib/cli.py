"""``benchmarks/decode.py``'s command line, and the pieces the other benchmark scripts share:
the checkpoint a benchmark runs (a path, or a random-weight model built from ``--arch/--size``),
routing replayed from a trace, and the research switches of the decode benchmark (I/O modes,
slot lookups, page-cache shares, paired rounds). ``moeflux-mlx bench``
(``moeflux_mlx.commands.bench``) is the user's smaller version of it."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import List, Optional, Tuple, Union

from mlx_lm.utils import load_tokenizer

from benchmarks.lib.decode import PAGE_CACHE_CHOICES, check_page_cache, run_benchmark
from benchmarks.lib.report import format_table, summary_lines, write_results
from benchmarks.lib.trace_routing import drive_routing, load_trace
from moeflux_mlx.commands.bench import budget_list
from moeflux_mlx.commands.common import (
    UsageError,
    lower,
    positive_int,
    resolve_model,
    say,
)
from moeflux_mlx.format.checkpoint import is_packed
from moeflux_mlx.format.convert import convert
from moeflux_mlx.measure import machine_tag, plot_unavailable
from moeflux_mlx.options import BACKENDS, user_cache_dir
from tests.support import synth

RESULTS = Path(__file__).resolve().parents[1] / "results"
IO_CHOICES = ("mmap", "pread", "direct")


def io_list(text: str) -> List[str]:
    modes = [lower(m) for m in text.split(",")]
    bad = [m for m in modes if m not in IO_CHOICES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or text!r}: expected a list of {', '.join(IO_CHOICES)}"
        )
    return modes


def _page_cache(text: str) -> Union[str, float]:
    if lower(text) in PAGE_CACHE_CHOICES:
        return lower(text)
    try:
        value = float(text)
        check_page_cache(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected {', '.join(PAGE_CACHE_CHOICES)} or a share of the experts "
            "in (0, 1]"
        ) from None
    return value


def add_model_args(p: argparse.ArgumentParser, size: str = "small") -> None:
    """The checkpoint a benchmark runs (``benchmark_model``'s): ``MODEL``, or one built from
    ``--arch/--size/--layers/--set`` into ``--build-dir``."""
    p.add_argument(
        "model",
        nargs="?",
        type=Path,
        help="checkpoint to benchmark, plain or "
        "converted (default: build a random-weight one with --arch/--size)",
    )
    p.add_argument("--arch", default="qwen3_moe", choices=synth.ARCHITECTURES)
    p.add_argument("--size", default=size, choices=synth.SIZES)
    p.add_argument(
        "--layers", type=positive_int, help="number of decoder layers of the built model"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config field of the built model, e.g. num_experts=16 (JSON value)",
    )
    build_dir = user_cache_dir() / "bench-models"
    p.add_argument(
        "--build-dir",
        type=Path,
        default=build_dir,
        help=f"where built models (and converted copies of them) are kept (default: {build_dir})",
    )


def add_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``benchmarks/decode.py``."""
    add_model_args(p)
    p.add_argument(
        "--budgets",
        type=budget_list,
        default=budget_list("1,0.99,0.5,0.25,0"),
        help="cache budgets as fractions of the experts (default: 1,0.99,0.5,0.25,0; 0.99: "
        "nearly all hits, one sync per layer: measures the sync overhead)",
    )
    p.add_argument(
        "--io",
        type=io_list,
        default=["mmap", "pread"],
        help="I/O modes to run, of mmap,pread,direct (default: mmap,pread)",
    )
    p.add_argument("--prompt-tokens", type=positive_int, default=128)
    p.add_argument(
        "--prompt-file",
        type=Path,
        default=None,
        metavar="TEXT",
        help="start from this text (its first --prompt-tokens tokens, with the model's tokenizer) "
        "instead of random token ids: a trained model then routes as for a user",
    )
    p.add_argument("--decode-tokens", type=positive_int, default=64)
    p.add_argument(
        "--bench-backend",
        type=lower,
        choices=BACKENDS,
        default=None,
        help="expert backend (default: auto)",
    )
    p.add_argument("--no-stock", action="store_true", help="skip stock mlx-lm")
    p.add_argument(
        "--lookup",
        default="both",
        choices=["both", "device", "host"],
        help="where the device-side table can run (CUDA), budgets below 100%% decode with both "
        "slot lookups (both, the default), only through the table (device) or only with a host "
        "sync per layer (host); elsewhere the host's is the only one",
    )
    p.add_argument(
        "--convert",
        action="store_true",
        help="stream the experts from a converted copy (MODEL-packed, made once), as "
        "for a model larger than RAM; stock mlx-lm runs from MODEL",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="with N > 1: also load stock and the all-resident configuration (on a GPU "
        "with the ops and the kernel backends) side by side and let them decode "
        "in turn N times; report the median ratio (run-to-run noise)",
    )
    p.add_argument(
        "--routing-trace",
        type=Path,
        default=None,
        metavar="TRACE",
        help="replay this routing trace (benchmarks/cache_policy.py's .npz) in every model's "
        "routers: a trained model's reuse and skew at this model's expert sizes; the "
        "model must have the trace's experts per layer and top-k (e.g. --set num_experts=64); "
        "the output tokens are meaningless by design",
    )
    p.add_argument(
        "--page-cache",
        type=_page_cache,
        default="dropped",
        metavar="{dropped,kept,SHARE}",
        help="cold runs (budgets below 100%%): dropped = the expert files dropped from the page "
        "cache all along, as for experts many times RAM (default); kept = dropped once, then "
        "the page cache keeps what RAM lets it keep (a model larger than RAM as it runs); "
        "SHARE (0-1] = kept, while another process holds all of RAM but that share of the "
        "experts' bytes (Linux)",
    )
    p.add_argument("--machine", default=None, help="machine label for the results file name")
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="folder for the results: DATE-MACHINE-decode.json, .md and .png (default: "
        "benchmarks/results); an existing result is never overwritten (-2, -3, ... is added)",
    )


def parse_config_setting(text: str):
    """``"num_experts=16"`` -> ``("num_experts", 16)`` (the value read as JSON, else a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"--set wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _prompt_ids(text_file: Optional[Path], model: Path, n: int) -> Optional[List[int]]:
    """The first ``n`` token ids of ``text_file`` with ``model``'s tokenizer (None: no file)."""
    if text_file is None:
        return None
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--prompt-file {text_file}: cannot read it as text ({e})") from None
    ids = load_tokenizer(Path(model)).encode(text)[:n]
    if len(ids) < n:
        raise UsageError(
            f"--prompt-file {text_file}: {len(ids)} tokens, fewer than --prompt-tokens {n}"
        )
    return ids


def replayed_routing(trace_path: Optional[Path]):
    """``run_benchmark``'s ``prepare`` hook for ``--routing-trace`` (None: models as loaded)."""
    if trace_path is None:
        return None
    trace = load_trace(trace_path)
    say(
        f"Routing replayed from {trace_path} ({trace.routed.shape[0]} tokens, "
        f"{len(trace.layers)} layers, {trace.num_experts[0]} experts, top-{trace.top_k}): "
        "the output tokens are meaningless by design."
    )
    return lambda model: drive_routing(model, trace, trace_path)


def benchmark_model(args: argparse.Namespace) -> Tuple[Path, Optional[Path]]:
    """The checkpoint a benchmark streams from: ``args.model``, or a random-weight one built once
    into ``args.build_dir`` from ``--arch/--size/--layers/--set``; with ``--convert``, its
    converted copy (made once).

    Args:
        args: a namespace with ``model``, ``arch``, ``size``, ``layers``, ``set``,
            ``build_dir`` and ``convert`` (``add_args``'s).

    Returns:
        ``(path to stream from, path stock mlx-lm loads or None: the same)``.

    Raises:
        UsageError: the built model's config cannot take a ``--set``.
    """
    model = args.model
    if model is None:
        overrides = dict(parse_config_setting(v) for v in args.set)
        name = f"{args.arch}-{args.size}" + "".join(f"-{k}{v}" for k, v in overrides.items())
        if args.layers:
            overrides["num_hidden_layers"] = args.layers
            name += f"-{args.layers}l"
        model = Path(args.build_dir).expanduser() / name
        if not model.exists():
            say(f"Building {model} (random weights; once) ...")
            try:
                synth.build_checkpoint(model, args.arch, args.size, overrides=overrides or None)
            except (ValueError, TypeError, KeyError) as e:  # a --set the config cannot take
                raise UsageError(
                    f"cannot build {args.arch}/{args.size} with {args.set}: {e}"
                ) from None
    else:
        model = resolve_model(str(model))
    stock_path = None
    if args.convert and not is_packed(model):
        # one contiguous blob per expert; a plain checkpoint scatters each over nine ranges,
        # which read cold at ~0.8x the speed (docs/benchmarks.md)
        packed = model.with_name(model.name + "-packed")
        convert(model, packed, progress=False, notify=say)  # nothing to do once made
        model, stock_path = packed, model
    return model, stock_path


def run(args: argparse.Namespace) -> int:
    model = args.model
    # as parsed here, or as strings from an older caller of run()
    budgets = args.budgets if isinstance(args.budgets, list) else budget_list(args.budgets)
    io_modes = args.io if isinstance(args.io, list) else io_list(args.io)
    model, stock_path = benchmark_model(args)
    out = Path(args.out).expanduser()
    prepare = replayed_routing(args.routing_trace)
    result = run_benchmark(
        model,
        budgets=budgets,
        io_modes=io_modes,
        prompt_tokens=args.prompt_tokens,
        prompt=_prompt_ids(args.prompt_file, stock_path or model, args.prompt_tokens),
        decode_tokens=args.decode_tokens,
        stock=not args.no_stock,
        stock_path=stock_path,
        backend=args.bench_backend,
        repeats=args.repeats,
        prepare=prepare,
        page_cache=args.page_cache,
        lookup=args.lookup,
    )
    result["routing_trace"] = str(args.routing_trace) if args.routing_trace else None
    print(format_table(result))
    for line in summary_lines(result):
        print(line)
    machine = args.machine or machine_tag(result["machine"])
    for f in write_results(result, out, f"{datetime.date.today()}-{machine}-decode"):
        print("wrote", f)
    why = plot_unavailable()
    if why:
        print(f"no plot: {why}")
    return 0
