"""Decode benchmark (issue 7): stock mlx-lm vs moeflux-mlx at several cache budgets, both I/O modes.

    python benchmarks/decode.py --model PATH            # an mlx-lm checkpoint (plain or converted)
    python benchmarks/decode.py --arch qwen3_moe --size small   # builds a random-weight model

Prints a table and writes benchmarks/results/<date>-<machine>-decode.{json,md,png}.
The same runs as `moeflux-mlx bench`.
"""

import argparse
import datetime
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeflux_mlx import bench, synth  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint to benchmark (default: build one)")
    p.add_argument("--arch", default="qwen3_moe", choices=synth.ARCHITECTURES)
    p.add_argument("--size", default="small", choices=synth.SIZES)
    p.add_argument("--layers", type=int, help="number of decoder layers of the built model")
    p.add_argument("--build-dir", type=Path, default=Path(".cache/bench-models"))
    p.add_argument("--budgets", default="1,0.5,0.25,0", help="cache budgets, fractions of the experts")
    p.add_argument("--io", default="mmap,pread")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--backend", default=None)
    p.add_argument("--no-stock", action="store_true")
    p.add_argument("--prefetch", default="off", choices=["off", "on", "both"])
    p.add_argument("--machine", default=None, help="machine label for the results file name")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = args.model
    if model is None:
        overrides = {"num_hidden_layers": args.layers} if args.layers else None
        name = f"{args.arch}-{args.size}" + (f"-{args.layers}l" if args.layers else "")
        model = args.build_dir / name
        if not model.exists():
            synth.build_checkpoint(model, args.arch, args.size, overrides=overrides)
    result = bench.run_benchmark(
        model, budgets=[float(b) for b in args.budgets.split(",")], io_modes=args.io.split(","),
        prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
        stock=not args.no_stock, backend=args.backend,
        prefetch={"off": (False,), "on": (True,), "both": (False, True)}[args.prefetch])
    print(bench.format_table(result))
    gpu = result["machine"].split(",")[0] if "," in result["machine"] else ""
    machine = args.machine or (gpu.split()[-1].lower() if gpu else f"cpu{bench.psutil.cpu_count()}")
    stem = f"{datetime.date.today()}-{machine}-decode"
    for f in bench.write_results(result, args.out, stem):
        print("wrote", f)


if __name__ == "__main__":
    main()
