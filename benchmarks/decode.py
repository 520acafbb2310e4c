"""Decode benchmark: stock mlx-lm vs moeflux-mlx at several cache budgets, both I/O modes,
prefetch off and on; the same as ``moeflux-mlx bench`` (``moeflux_mlx.commands.bench``), with
the results written under benchmarks/results/.

    python benchmarks/decode.py PATH                               # plain or converted checkpoint
    python benchmarks/decode.py --arch qwen3_moe --size full --layers 8   # builds a random model

Prints a table and writes benchmarks/results/<date>-<machine>-decode.{json,md,png}.
"""

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeflux_mlx.commands import bench as bench_cmd  # noqa: E402
from moeflux_mlx.commands.common import main_for  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bench_cmd.add_args(parser)
    parser.set_defaults(out=Path(__file__).parent / "results")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main_for(parser, bench_cmd.run))  # bad input: one line, exit status 2
