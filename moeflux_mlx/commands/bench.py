"""``moeflux-mlx bench [MODEL]``: your model's decode speed with moeflux-mlx at a few cache
budgets, against stock mlx-lm on the same prompt; prints a table and writes JSON, markdown and,
with matplotlib, a plot (``moeflux_mlx.measure``)."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import List, Optional

from ..measure import format_table, machine_tag, plot_unavailable, run_bench, write_results
from ..options import IO_MODES
from .common import command_parser, lower, main_for, positive_int, resolve_model, say

DESCRIPTION = (
    "decode speed at a few cache budgets against stock mlx-lm on the same prompt; "
    "writes JSON, markdown and a plot"
)
DEFAULT_OUT = Path("moeflux-bench-results")
DEFAULT_BUDGETS = "1,0.5,0.25"


def budget_list(text: str) -> List[float]:
    """``--budgets``: shares of the experts held in the cache.

    Args:
        text: comma-separated numbers, e.g. ``1,0.5,0.25``.

    Returns:
        The shares, in the order given.

    Raises:
        argparse.ArgumentTypeError: a part is not a number in [0, 1].
    """
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a number; expected fractions of the experts in [0, 1], "
                "e.g. 1,0.5,0"
            ) from None
        if not 0 <= value <= 1:
            raise argparse.ArgumentTypeError(f"{part.strip()} is not a fraction in [0, 1]")
        out.append(value)
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model directory (plain mlx-lm or converted) or Hugging Face repo id "
        "(default: the built-in demo model)",
    )
    p.add_argument(
        "--budgets",
        type=budget_list,
        default=budget_list(DEFAULT_BUDGETS),
        help=f"cache budgets as shares of the experts, each in [0, 1] (default: {DEFAULT_BUDGETS})",
    )
    p.add_argument("--prompt-tokens", type=positive_int, default=128, help="default: 128")
    p.add_argument("--decode-tokens", type=positive_int, default=64, help="default: 64")
    p.add_argument(
        "--expert-io",
        type=lower,
        choices=IO_MODES,
        default=None,
        help="how experts are read from disk (default: $MOEFLUX_EXPERT_IO or auto)",
    )
    p.add_argument("--no-stock", action="store_true", help="skip stock mlx-lm")
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"folder for the results: DATE-MACHINE-decode.json, .md and .png (default: "
        f"./{DEFAULT_OUT}); an existing result is never overwritten (-2, -3, ... is added)",
    )
    p.add_argument(
        "--machine", default=None, help="machine name in the results' file names (default: guessed)"
    )


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    result = run_bench(
        path,
        budgets=args.budgets,
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens,
        expert_io=args.expert_io,
        stock=not args.no_stock,
        progress=say,
    )
    print(format_table(result))
    machine = args.machine or machine_tag(result["machine"])
    stem = f"{datetime.date.today()}-{machine}-decode"
    for f in write_results(result, Path(args.out).expanduser(), stem):
        print("wrote", f)
    why = plot_unavailable()
    if why:
        print(f"no plot: {why}")
    return 0


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("bench", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
