"""Does MLX's own quantized gather-matmul read out of bounds (CUDA)? Stock mlx-lm only.

Does what ``tests/test_prefill.py`` does before its first ``[device]`` test loads anything of
moeflux's: conftest's tiny checkpoints of every demo architecture, built and converted in this
process, then stock mlx-lm's prefill of the qwen3_moe one (40 tokens), its greedy tokens and the
37 + 3 split. No moeflux model, no miss server, none of our kernels or CUDA runtime calls. Run it
under the memory checker:

    compute-sanitizer --tool memcheck --print-limit 10000 python3 benchmarks/probes/mlx_qmm_oob_probe.py

Building the other checkpoints first only changes where MLX places the small arrays; with the
qwen3_moe checkpoint alone the same prefill showed no error (docs/benchmarks.md, known problems).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from moeflux_mlx.format.convert import convert
from moeflux_mlx.testing import synth


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only-qwen", action="store_true", help="build the qwen3_moe checkpoint alone"
    )
    parser.add_argument("--rounds", type=int, default=3, help="37 + 3 split prefills")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qmm-oob-") as tmp:
        run(Path(tmp), args)


def run(root: Path, args: argparse.Namespace) -> None:
    arches = ["qwen3_moe"] if args.only_qwen else list(synth.ARCHITECTURES)
    checkpoints = {}
    for arch in arches:
        src = synth.build_checkpoint(root / arch, arch, "tiny", seed=1)
        checkpoints[arch] = (src, convert(src, root / f"{arch}-packed", progress=False))
    print(f"checkpoints built: {len(checkpoints)}", flush=True)
    stock, _ = mlx_lm.load(str(checkpoints["qwen3_moe"][0]))
    prompt = mx.array(np.random.default_rng(0).integers(0, 256, 40).astype(np.uint32))
    mx.eval(stock(prompt[None], cache=make_prompt_cache(stock)))
    tokens = [int(t) for (t, _), _ in zip(generate_step(prompt, stock, max_tokens=6), range(6))]
    print("prefill and greedy tokens:", tokens, flush=True)
    for _ in range(args.rounds):
        stock, _ = mlx_lm.load(str(checkpoints["qwen3_moe"][0]))
        cache = make_prompt_cache(stock)
        mx.eval(stock(prompt[None, :-3], cache=cache))
        mx.eval(stock(prompt[None, -3:], cache=cache))
        mx.synchronize()
    print("split prefills done")
    print("moeflux's CUDA runtime loaded:", "moeflux_mlx.cuda.runtime" in sys.modules)


if __name__ == "__main__":
    main()
