"""``moeflux-mlx demo``: generate on the built-in demo model, its experts streamed from disk."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from .. import demo_model
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

DESCRIPTION = "generate on the built-in demo model (a small trained qwen3_moe)"


def run(args: argparse.Namespace) -> int:
    if args.path:
        print(demo_model.checkpoint_path())
        return 0
    args.model = None
    # generate's flags that demo does not take, at their defaults
    defaults = command_parser("generate", generate.DESCRIPTION, generate.add_args).parse_args([])
    for name, value in vars(defaults).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    rc = generate.run(args)
    say(
        "This was the built-in demo model (53 M parameters, trained on a few books and manuals). "
        f"Next: `{PROG} chat`, `{PROG} compare`, `{PROG} info MODEL`, "
        f"`{PROG} generate --model MODEL --prompt ...`."
    )
    return rc


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", "-p", default=DEMO_PROMPT, help=f"default: {DEMO_PROMPT!r}")
    p.add_argument("--path", action="store_true", help="print the demo model's directory and exit")
    p.add_argument("--system-prompt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ignore-chat-template", action="store_true", help=argparse.SUPPRESS)
    add_sampling_args(p, max_tokens=48)
    add_load_args(p)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("demo", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
