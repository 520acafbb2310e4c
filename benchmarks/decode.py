"""Decode benchmark, the research version of ``moeflux-mlx bench``: stock mlx-lm vs moeflux-mlx
at several cache budgets and I/O modes, both slot lookups where the device-side table runs, cold
runs with the page cache dropped, kept or held to a share of the experts, routing
replayed from a trace, paired rounds; results written under benchmarks/results/.

    python benchmarks/decode.py PATH                               # plain or converted checkpoint
    python benchmarks/decode.py --arch qwen3_moe --size full --layers 8   # builds a random model

Prints a table and writes benchmarks/results/<date>-<machine>-decode.{json,md,png}.
"""

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib import cli  # noqa: E402
from moeflux_mlx.commands.common import main_for  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_args(parser)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return main_for(parser, cli.run, argv)  # bad input: one line, exit status 2


if __name__ == "__main__":
    sys.exit(main())
