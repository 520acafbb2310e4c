"""Exactness against stock mlx-lm on the current MLX device (the CPU tests' check, on CUDA / Metal).

For each demo architecture: greedy decode with stock mlx-lm and with moeflux-mlx (packed source,
several cache modes and backends) from a 1-token and a 100+-token prompt; prints tokens identical
and the max |delta log-prob|, writes benchmarks/results/<date>-<machine>-exactness.md.
On the CPU backend the difference is exactly 0 (the unit tests assert it).
"""

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

import moeflux_mlx  # noqa: E402
from moeflux_mlx.benchmark import report  # noqa: E402
from moeflux_mlx.format.convert import convert  # noqa: E402
from moeflux_mlx.testing import synth  # noqa: E402


def decode(model, prompt, n):
    toks, lps = [], []
    for (t, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        toks.append(int(t))
        lps.append(lp)
    return toks, mx.stack(lps).astype(mx.float32)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", default="tiny", choices=synth.SIZES)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--backends", default="ops,auto")
    p.add_argument("--archs", default=",".join(synth.ARCHITECTURES))
    p.add_argument("--machine", default=None)
    p.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "results")
    args = p.parse_args(argv)
    rows = []
    root = Path(tempfile.mkdtemp())
    for arch in args.archs.split(","):
        src = synth.build_checkpoint(root / arch, arch, args.size, seed=1)
        packed = convert(src, root / f"{arch}-packed", progress=False)
        ref, tok = mlx_lm.load(str(src))
        prompts = {
            "1-token": tok.encode("hi", add_special_tokens=False)[:1],
            "120-token": tok.encode(" ".join(["the quick brown fox jumps"] * 24))[:120],
        }
        want = {k: decode(ref, v, args.tokens) for k, v in prompts.items()}
        for backend in args.backends.split(","):
            for budget in (0, "all"):
                model, _ = moeflux_mlx.load(packed, backend=backend, cache_budget=budget)
                with model.moeflux as rt:
                    for name, prompt in prompts.items():
                        toks, lps = decode(model, prompt, args.tokens)
                        same = sum(a == b for a, b in zip(toks, want[name][0]))
                        first = next(
                            (i for i, (a, b) in enumerate(zip(toks, want[name][0])) if a != b), None
                        )
                        n = min(len(toks), len(want[name][0]))
                        # log-probs are comparable while the tokens agree
                        upto = n if first is None else first + 1
                        dlp = float(mx.abs(lps[:upto] - want[name][1][:upto]).max())
                        ref_nan = bool(mx.isnan(want[name][1]).any())
                        rows.append(
                            (
                                arch,
                                rt.backend.name,
                                str(budget),
                                name,
                                f"{same}/{n}",
                                "-" if first is None else str(first),
                                f"{dlp:.3g}",
                                "NaN" if ref_nan else "finite",
                            )
                        )
                        print(*rows[-1], flush=True)
    head = (
        "arch",
        "backend",
        "cache budget",
        "prompt",
        "tokens identical",
        "first divergence",
        "max |d logprob|",
        "stock log-probs",
    )
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    machine = report.machine_name()
    label = args.machine or (machine.split(",")[0].split()[-1].lower() if "," in machine else "cpu")
    out = args.out / f"{datetime.date.today()}-{label}-exactness.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# Exactness against stock mlx-lm: {args.size} demo models\n\nMachine: {machine}; "
        f"MLX {mx.__version__} ({mx.default_device()}); greedy, {args.tokens} tokens.\n\n"
        + "\n".join(table)
        + "\n"
    )
    print("\n".join(table))
    print("wrote", out)


if __name__ == "__main__":
    main()
