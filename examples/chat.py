"""Chat in the terminal with an MoE model whose experts stream from disk.

    python examples/chat.py                        # the built-in demo model (a small trained MoE)
    python examples/chat.py --model PATH           # a converted dir or an mlx-lm MoE checkpoint
    python examples/chat.py --model PATH --prompt "Hello"   # one reply, then exit

/reset starts a new conversation; /quit, q or Ctrl-D exits; another /word is taken for a
mistyped command, not sent (//text sends /text). See `--help` for sampling
(--temp, --top-p, --max-tokens, --seed) and streaming (--expert-io, --backend, --cache-budget) options.
Same as `moeflux-mlx chat`. Needs moeflux-mlx importable (`pip install -e .`, or PYTHONPATH=.).
"""

import sys

from moeflux_mlx.commands.chat import main

if __name__ == "__main__":
    sys.exit(main())
