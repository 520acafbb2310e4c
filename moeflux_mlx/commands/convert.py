"""``moeflux-mlx convert``: an mlx-lm checkpoint into a streaming directory (experts packed one
file per MoE layer).

Rerunning a finished conversion of the same source does nothing and succeeds, so that
``moeflux-mlx convert SRC DST && moeflux-mlx generate --model DST`` can be run again. An
interrupted conversion (Ctrl-C, a full disk) keeps ``DST.partial``, and says so; a rerun resumes
there, and says that too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

from ..format.checkpoint import packed_layout
from ..format.convert import convert, verify_conversion
from ..model.source import resolve_model_path
from .common import EXIT_INTERRUPTED, command_parser, fmt_bytes, main_for, say

DESCRIPTION = (
    "convert an mlx-lm checkpoint into a streaming directory (experts packed one file "
    "per MoE layer)"
)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    src, dst = resolve_model_path(args.src), Path(args.dst).expanduser()
    work = dst.with_name(dst.name + ".partial")
    # convert() returns an existing DST only when it is a finished conversion of SRC
    finished = dst.is_dir() and any(dst.iterdir())
    try:
        dst = convert(src, dst, verify=args.verify, progress=not args.quiet, notify=say)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        if work.is_dir():
            say(
                f"Interrupted: {dst} was not created; the completed part is kept in {work} "
                "and a rerun of the same command resumes there (delete it to reclaim the space)."
            )
        else:
            say(f"Interrupted: {dst} was not created; nothing was written.")
        return EXIT_INTERRUPTED
    if finished:
        if args.verify:
            verify_conversion(src, dst, progress=not args.quiet)
            print(f"{dst}: verified byte for byte against {src}")
        return 0
    layout = packed_layout(dst)
    print(
        f"Converted {src} -> {dst} in {time.perf_counter() - t0:.1f} s: "
        f"{len(layout.layers)} MoE layers, {fmt_bytes(layout.total_expert_bytes)} of experts"
        + (" (verified byte for byte)" if args.verify else "")
    )
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="mlx-lm checkpoint directory")
    p.add_argument(
        "dst",
        metavar="DST",
        help="directory to write: new or empty (a finished conversion of SRC: nothing to do)",
    )
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
