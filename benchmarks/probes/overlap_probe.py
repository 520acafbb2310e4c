"""Where does the host wait during pipelined decode with misses? Build / encode / wait per token.

mlx-lm's loop runs one token ahead: it builds token t+1's graph, encodes it (``mx.async_eval``),
then waits for token t (``.item()``). With the device-side table, a miss stalls only the GPU, so
the host's build and encode of t+1 should hide under token t's wait, and a cold token should take
about max(host time, GPU time). This probe runs that loop by hand and times its three parts per
token:

- encode long while the GPU waits: the host is blocked inside MLX's encoding (throttle, launch
  queue, a lock shared with the stalled stream);
- wait long and build + encode short: the host runs ahead as intended, and the per-token time
  is the GPU's own (waits, copies, kernels).

On an H100 (benchmarks/results/2026-11-25-h100-notes.md; docs/benchmarks.md) it was the second:
a cold token is the GPU's waits plus its own work, one after the other.

    python benchmarks/probes/overlap_probe.py MODEL [--budgets 0.25,0.05] [--tokens 64] [--rounds 3]

MODEL: a converted or plain checkpoint (e.g. the ``-packed`` copy ``benchmarks/decode.py
--convert`` made). Budgets below 1 run pread with the page cache dropped throughout, as the decode
benchmark's cold rows do; stock mlx-lm and every expert resident are the references.
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import moeflux_mlx  # noqa: E402
from moeflux_mlx.benchmark.pagecache import PageCacheDropper, expert_files  # noqa: E402
from moeflux_mlx.format.checkpoint import expert_layout  # noqa: E402


def pipelined_split(model, prompt, tokens, after_prefill=None):
    """Means in ms of (build, encode, wait, whole token) per token, decoding one token ahead
    (means: a miss stalls some tokens and not others, and medians would hide them).
    ``after_prefill`` runs once the prompt is evaluated (e.g. to reset counters)."""
    cache = make_prompt_cache(model)

    def step(y):
        return mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)  # y: [L] -> [1]

    y = step(prompt)
    mx.eval(y)
    if after_prefill is not None:
        after_prefill()
    nxt = step(y)
    mx.async_eval(nxt)
    parts = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        after = step(nxt)
        t1 = time.perf_counter()
        mx.async_eval(after)
        t2 = time.perf_counter()
        nxt.item()
        t3 = time.perf_counter()
        parts.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        nxt = after
    mx.eval(nxt)
    return [1e3 * statistics.mean(p[i] for p in parts) for i in range(4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument(
        "--stock",
        type=Path,
        help="plain checkpoint for stock mlx-lm "
        "(default: MODEL, if it is not a converted directory)",
    )
    ap.add_argument("--budgets", default="0.25", help="cold budgets, comma-separated")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    mx.random.seed(0)
    prompt = mx.random.randint(0, 256, (128,)).astype(mx.uint32)
    models = {}
    stock = args.stock or (None if (args.model / "packed_experts").exists() else args.model)
    if stock is not None:
        models["stock mlx-lm"] = (mlx_lm.load(str(stock))[0], False)
    # pread even where the RAM gate would map the files: a map held open keeps the pages in the
    # page cache (fadvise cannot drop mapped pages), and the cold model's reads would hit them
    models["moeflux, every expert resident"] = (
        moeflux_mlx.load(args.model, expert_io="pread", cache_budget="all")[0],
        False,
    )
    # budgets in bytes, as the decode benchmark's
    expert_bytes = expert_layout(args.model).total_expert_bytes
    for frac in (float(b) for b in args.budgets.split(",")):
        models[f"moeflux, {frac:.0%} cold"] = (
            moeflux_mlx.load(args.model, expert_io="pread", cache_budget=int(frac * expert_bytes))[
                0
            ],
            True,
        )
    files = expert_files(args.model)
    rows = {k: [] for k in models}
    gpu_wait = {k: [] for k in models}  # the GPU's waits for the miss server, ms per token
    missed = {k: [] for k in models}  # experts read per decode token
    reading = {k: [] for k in models}  # the miss server's reading, ms per decode token
    for m, _ in models.values():
        pipelined_split(m, prompt, 4)  # warm-up: kernels of these shapes, the first fills
    for _ in range(args.rounds):
        for name, (m, cold) in models.items():
            reset = (lambda m=m: moeflux_mlx.reset_stats(m)) if hasattr(m, "moeflux") else None
            with PageCacheDropper(files) if cold else contextlib.nullcontext():
                rows[name].append(pipelined_split(m, prompt, args.tokens, reset))
            if reset is not None:  # decode steps since the prefill: one, then one per token
                counted = moeflux_mlx.stats(m)["total"]
                n = args.tokens + 1
                gpu_wait[name].append(1e3 * counted["gpu_wait_s"] / n)
                missed[name].append(counted["experts_missed"] / n)
                reading[name].append(1e3 * counted["io_s"] / n)
    print(
        f"{args.model.name}, {mx.default_device()}, MLX {mx.__version__}; pipelined one token "
        f"ahead as mlx-lm does; ms per token, means over {args.tokens} tokens, medians over "
        f"{args.rounds} rounds"
    )
    print(
        "| model | build t+1 | encode t+1 | wait for t | token | GPU's waits for misses "
        "| reading | experts missed/tok |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, v in rows.items():
        b, e, w, t = (statistics.median(r[i] for r in v) for i in range(4))
        g, io, n = (
            f"{statistics.median(x[name]):.3f}" if x[name] else "-"
            for x in (gpu_wait, reading, missed)
        )
        print(f"| {name} | {b:.3f} | {e:.3f} | {w:.3f} | {t:.3f} | {g} | {io} | {n} |")
    for m, _ in models.values():
        if hasattr(m, "moeflux"):
            m.moeflux.close()


if __name__ == "__main__":
    main()
