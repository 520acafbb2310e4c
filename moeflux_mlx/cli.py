"""The ``moeflux-mlx`` command: dispatches to ``moeflux_mlx.commands``, as mlx-lm's ``cli.py``
does to its modules.

    moeflux-mlx generate  one-shot generation (like ``mlx_lm.generate``)
    moeflux-mlx chat      interactive multi-turn chat
    moeflux-mlx convert   convert an mlx-lm checkpoint into a streaming directory
    moeflux-mlx info      what streams, how big it is, and how it would be read
    moeflux-mlx compare   stock mlx-lm vs moeflux-mlx on the same prompts
    moeflux-mlx demo      generate on the built-in demo model (--path: print its folder)
    moeflux-mlx server    mlx-lm's OpenAI-compatible server, experts streamed
    moeflux-mlx bench     the decode benchmark against stock mlx-lm
    moeflux-mlx doctor    versions, device, kernel self-check, memory, budget and decode forecast
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, Optional, Type, TypedDict

from . import __version__
from .commands import bench, chat, common, compare, convert, demo, doctor, generate, info, server

COMMANDS = {
    "generate": generate,
    "chat": chat,
    "convert": convert,
    "info": info,
    "compare": compare,
    "demo": demo,
    "server": server,
    "bench": bench,
    "doctor": doctor,
}


class _ParserKwargs(TypedDict, total=False):
    epilog: str
    formatter_class: Type[argparse.HelpFormatter]


# parser keywords a command needs beyond its description
_PARSER_KWARGS: Dict[str, _ParserKwargs] = {
    "server": {"epilog": server.EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=common.PROG,
        description="Streaming-experts MoE inference for MLX: run MoE models "
        "whose experts exceed memory inside mlx-lm.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=module.DESCRIPTION,
            description=module.DESCRIPTION,
            **_PARSER_KWARGS.get(name, {}),
        )
        common.add_common_args(p)
        module.add_args(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: Optional[list] = None) -> int:
    return common.main_for(build_parser(), lambda args: args.func(args), argv)


if __name__ == "__main__":
    sys.exit(main())
