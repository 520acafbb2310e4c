"""``moeflux-mlx bench`` (and ``benchmarks/decode.py``): the decode benchmark against stock
mlx-lm at several cache budgets, both I/O modes, prefetch off/on; writes JSON, markdown and a
plot (``benchmark``)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Optional

from ..benchmark.decode import run_benchmark
from ..benchmark.report import format_table, machine_tag, summary_lines, write_results
from ..format.checkpoint import is_packed
from ..format.convert import convert
from ..testing import synth
from .common import command_parser, main_for

DESCRIPTION = (
    "decode benchmark: stock mlx-lm and moeflux-mlx at several cache budgets, both I/O "
    "modes, prefetch off/on; writes JSON, markdown and a plot"
)


def add_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``moeflux-mlx bench`` and ``benchmarks/decode.py``."""
    p.add_argument(
        "model",
        nargs="?",
        type=Path,
        help="checkpoint to benchmark, plain or "
        "converted (default: build a random-weight one with --arch/--size)",
    )
    p.add_argument("--arch", default="qwen3_moe", choices=synth.ARCHITECTURES)
    p.add_argument("--size", default="small", choices=synth.SIZES)
    p.add_argument("--layers", type=int, help="number of decoder layers of the built model")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config field of the built model, e.g. num_experts=16 (JSON value)",
    )
    p.add_argument("--build-dir", type=Path, default=Path(".cache/bench-models"))
    p.add_argument(
        "--budgets",
        default="1,0.99,0.5,0.25,0",
        help="cache budgets as fractions of the experts (0.99: nearly all hits, one "
        "sync per layer: measures the sync overhead)",
    )
    p.add_argument("--io", default="mmap,pread", help="I/O modes to run")
    p.add_argument("--prefetch", default="both", choices=["off", "on", "both"])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--bench-backend", default=None, help="expert backend (default: auto)")
    p.add_argument("--no-stock", action="store_true", help="skip stock mlx-lm")
    p.add_argument(
        "--convert",
        action="store_true",
        help="stream the experts from a converted copy (MODEL-packed, made once), as "
        "for a model larger than RAM; stock mlx-lm runs from MODEL",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with N > 1: also load stock and the all-resident configuration (on a GPU "
        "with the ops and the kernel backends) side by side and let them decode "
        "in turn N times; report the median ratio (run-to-run noise)",
    )
    p.add_argument("--machine", default=None, help="machine label for the results file name")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))


def parse_config_setting(text: str):
    """``"num_experts=16"`` -> ``("num_experts", 16)`` (the value read as JSON, else a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        overrides = dict(parse_config_setting(v) for v in args.set)
        name = f"{args.arch}-{args.size}" + "".join(f"-{k}{v}" for k, v in overrides.items())
        if args.layers:
            overrides["num_hidden_layers"] = args.layers
            name += f"-{args.layers}l"
        model = args.build_dir / name
        if not model.exists():
            synth.build_checkpoint(model, args.arch, args.size, overrides=overrides or None)
    stock_path = None
    if args.convert and not is_packed(model):
        # one contiguous blob per expert; a plain checkpoint scatters each over nine ranges,
        # which read cold at ~0.8x the speed (docs/benchmarks.md)
        packed = model.with_name(model.name + "-packed")
        if not packed.exists():
            convert(model, packed)
        model, stock_path = packed, model
    result = run_benchmark(
        model,
        budgets=[float(b) for b in args.budgets.split(",")],
        io_modes=args.io.split(","),
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens,
        stock=not args.no_stock,
        stock_path=stock_path,
        backend=args.bench_backend,
        repeats=args.repeats,
        prefetch={"off": (False,), "on": (True,), "both": (False, True)}[args.prefetch],
    )
    print(format_table(result))
    for line in summary_lines(result):
        print(line)
    machine = args.machine or machine_tag(result["machine"])
    for f in write_results(result, args.out, f"{datetime.date.today()}-{machine}-decode"):
        print("wrote", f)
    return 0


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("bench", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
