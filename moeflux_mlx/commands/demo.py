"""``moeflux-mlx demo``: build the small demo model once, then generate on it."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from . import generate
from .common import (
    DEMO_PROMPT,
    PROG,
    add_load_args,
    add_sampling_args,
    command_parser,
    main_for,
    say,
)

DESCRIPTION = "build the small demo model (once) and generate on it"


def run(args: argparse.Namespace) -> int:
    args.model = None
    rc = generate.run(args)
    say(
        "This was the random-weight demo model: the pipeline ran, the words mean nothing. Next: "
        f"`{PROG} chat`, `{PROG} info MODEL`, `{PROG} generate --model MODEL --prompt ...`."
    )
    return rc


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", "-p", default=DEMO_PROMPT, help=f"default: {DEMO_PROMPT!r}")
    p.add_argument("--system-prompt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ignore-chat-template", action="store_true", help=argparse.SUPPRESS)
    add_sampling_args(p, max_tokens=48)
    add_load_args(p)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("demo", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
