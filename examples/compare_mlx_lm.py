"""Compare moeflux-mlx with stock mlx-lm on the same checkpoint: tokens, log-probs, speed.

    python examples/compare_mlx_lm.py                       # on the built-in demo model
    python examples/compare_mlx_lm.py PATH --prompt "Hi" -m 64
    python examples/compare_mlx_lm.py PATH --converted PATH-converted

Exit status 0 when the outputs agree (CPU: exactly; GPU: as close to a float32 reference as
stock is), 1 when they differ, 3 when not compared (stock mlx-lm did not run: the model does not
fit, --force).
Same as `moeflux-mlx compare`. Needs moeflux-mlx importable (`pip install -e .`, or PYTHONPATH=.).
"""

import sys

from moeflux_mlx.commands.compare import main

if __name__ == "__main__":
    sys.exit(main())
