"""``moeflux-mlx convert``: an mlx-lm checkpoint into a streaming directory (experts packed one
file per MoE layer)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

from ..format.checkpoint import packed_layout
from ..format.convert import convert
from .common import command_parser, fmt_bytes, main_for

DESCRIPTION = (
    "convert an mlx-lm checkpoint into a streaming directory (experts packed one file "
    "per MoE layer)"
)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    existed = Path(args.dst).exists()  # convert() accepts a finished conversion of the same SRC
    dst = convert(args.src, args.dst, verify=args.verify, progress=not args.quiet)
    layout = packed_layout(dst)
    done = "Already converted" if existed else "Converted"
    print(
        f"{done} {args.src} -> {dst} in {time.perf_counter() - t0:.1f} s: "
        f"{len(layout.layers)} MoE layers, {fmt_bytes(layout.total_expert_bytes)} of experts"
        + (" (verified byte for byte)" if args.verify else "")
    )
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="mlx-lm checkpoint directory")
    p.add_argument("dst", metavar="DST", help="new directory to write")
    p.add_argument(
        "--verify",
        action="store_true",
        help="re-read everything written and compare it with SRC byte for byte",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("convert", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
