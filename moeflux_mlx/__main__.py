"""``python -m moeflux_mlx COMMAND ...``: the ``moeflux-mlx`` command without its console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
