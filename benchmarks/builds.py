"""Two builds of the package side by side with stock mlx-lm, on one checkpoint: the headline
figures of a change, before and after.

Each build is a source tree holding ``moeflux_mlx`` (and ``metal_kernels``): this checkout, and
an older one, e.g. ``git archive 7541b5b moeflux_mlx metal_kernels | tar -x -C /tmp/base``.
Every measurement runs in a process of its own, with that tree first on ``PYTHONPATH``; the
processes take turns (stock, then each build, the order rotating each round), so machine noise
falls on all of them alike. Each process measures, after a short warm-up:

- ``resident``: decode tok/s with every expert resident (stock: the model as mlx-lm loads it);
- ``warm25``: decode at a budget of 25% of the experts' bytes, page cache warm, and its hit rate;
- ``prefill512``: seconds to the first token of a 512-token prompt at 25% (stock: resident), the
  better of two, and that token (it must be stock's);
- ``plain25`` / ``lookup25``: plain decoding and prompt lookup (K=4) of a repetitive prompt at
  25%, the better of two each;
- ``cold25``: decode at 25% with ``expert_io=direct`` (every miss read from the disk).

Only the stable public API is used (``moeflux_mlx.load`` with a budget in bytes, ``stats``,
``model.lookup_decoding.stream_lookup_generate``), so an older build runs it too.

    python benchmarks/builds.py MODEL --build new=. --build base=/tmp/base [--rounds 2]
        [--decode-tokens 64] [--machine NAME] [--out benchmarks/results]

Prints a table of medians over rounds (and each figure's range) and writes
``DATE-MACHINE-builds.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("resident", "warm25", "hit25", "prefill512", "plain25", "lookup25", "cold25")
RESULT = "RESULT "


def _child(variant: str, model: str, tokens: int) -> dict:
    """One process's figures (the builds' API only; imported here, from this process's path)."""
    import mlx.core as mx  # noqa: F401 - the device is chosen before any model is loaded
    import numpy as np
    from mlx_lm import stream_generate

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, min(20000, vocab), 128).tolist()
    out: Dict[str, object] = {}

    def last(gen):
        r = None
        for response in gen:
            r = response
        return r

    def decode(m, tok, p, n):
        return last(stream_generate(m, tok, p, max_tokens=n))

    def prefill(m, tok):
        p = rng.integers(100, min(20000, vocab), 512).tolist()
        best, first = None, None
        for _ in range(2):
            r = decode(m, tok, p, 1)
            s = r.prompt_tokens / r.prompt_tps
            best, first = (s, r.token) if best is None or s < best else (best, first)
        return best, first

    if variant == "stock":
        import mlx_lm

        model_, tok = mlx_lm.load(model)[:2]
        decode(model_, tok, prompt, 8)
        out["resident"] = decode(model_, tok, prompt, tokens).generation_tps
        out["prefill512"], out["first_token"] = prefill(model_, tok)
        return out

    import moeflux_mlx
    from moeflux_mlx.format.checkpoint import expert_layout
    from moeflux_mlx.model.lookup_decoding import stream_lookup_generate

    total = expert_layout(Path(model)).total_expert_bytes
    m, tok = moeflux_mlx.load(model, cache_budget=total)
    decode(m, tok, prompt, 8)
    out["resident"] = decode(m, tok, prompt, tokens).generation_tps
    m.moeflux.close()
    m, tok = moeflux_mlx.load(model, cache_budget=int(0.25 * total))
    decode(m, tok, prompt, 8)
    out["warm25"] = decode(m, tok, prompt, tokens).generation_tps
    out["hit25"] = moeflux_mlx.stats(m)["total"].get("hit_rate")
    out["prefill512"], out["first_token"] = prefill(m, tok)
    repetitive = rng.integers(100, min(20000, vocab), 16).tolist() * 8
    out["plain25"] = max(decode(m, tok, repetitive, tokens).generation_tps for _ in range(2))
    out["lookup25"] = max(
        last(
            stream_lookup_generate(m, tok, repetitive, max_tokens=tokens, num_draft_tokens=4)
        ).generation_tps
        for _ in range(2)
    )
    m.moeflux.close()
    m, tok = moeflux_mlx.load(model, cache_budget=int(0.25 * total), expert_io="direct")
    decode(m, tok, prompt, 4)
    out["cold25"] = decode(m, tok, prompt, tokens).generation_tps
    m.moeflux.close()
    return out


def _run(variant: str, tree: Path, args) -> dict:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, __file__, "--child", variant, str(args.model)]
    cmd += ["--decode-tokens", str(args.decode_tokens)]
    print(f"  {variant} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": tail[0]}


def _table(rows: Dict[str, List[dict]]) -> str:
    def cell(values: List[float]) -> str:
        if not values:
            return "-"
        med = statistics.median(values)
        return f"{med:.3g}" + (f" ({min(values):.3g}-{max(values):.3g})" if len(values) > 1 else "")

    head = "| build | " + " | ".join(FIGURES) + " | first token |"
    lines = [head, "|" + " --- |" * (len(FIGURES) + 2)]
    for name, runs in rows.items():
        ok = [r for r in runs if "error" not in r]
        cells = [cell([r[f] for r in ok if r.get(f) is not None]) for f in FIGURES]
        first = sorted({str(r.get("first_token")) for r in ok}) or ["-"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {', '.join(first)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--build", action="append", default=[], metavar="NAME=TREE")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--machine", default="local")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(_child(args.child, str(args.model), args.decode_tokens)))
        return 0
    builds = {"stock": ROOT}
    for spec in args.build or ["new=" + str(ROOT)]:
        name, _, tree = spec.partition("=")
        if not (Path(tree) / "moeflux_mlx").is_dir():
            p.error(f"--build {spec}: {tree} holds no moeflux_mlx")
        builds[name] = Path(tree).resolve()
    rows: Dict[str, List[dict]] = {name: [] for name in builds}
    names = list(builds)
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            rows[name].append(_run(name, builds[name], args))
    print(_table(rows))
    errors = [f"{n}: {r['error']}" for n, runs in rows.items() for r in runs if "error" in r]
    for e in errors:
        print("failed:", e, file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    path = args.out / f"{stamp}-{args.machine}-builds.json"
    path.write_text(json.dumps({"model": str(args.model), "rounds": rows}, indent=1))
    print(f"wrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
