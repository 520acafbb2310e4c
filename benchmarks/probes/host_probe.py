"""Where one decode token's time goes: building the graph (Python), encoding it (the host side
of ``mx.async_eval``: every primitive's kernels are issued), and waiting for the GPU to finish,
one token at a time without overlap; then the same models decoding pipelined, as mlx-lm does.

Models: stock mlx-lm, moeflux with every expert resident through the plain ops, through the
fused kernels, through the fused kernels with every expert looked up in the device-side table,
and with the experts skipped (the ceiling, ``SkippedExperts`` in moeflux_mlx/benchmark/decode.py).
``--poll-max-us 20,1000`` loads one table model per cap on the miss server's poll interval
(``MOEFLUX_SERVER_POLL_MAX_US``; 20 is a fixed 20 us poll, the old default), so the poller's cost
is compared within one run.
If build + encode is close to the pipelined time per token, decode is bound by the host, and
what counts is how many graph nodes a layer adds, not how fast its kernels run.

    python benchmarks/probes/host_probe.py MODEL [--tokens 64] [--rounds 3] [--poll-max-us 20,1000]

MODEL: a plain mlx-lm checkpoint (e.g. one ``benchmarks/decode.py`` built).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import moeflux_mlx  # noqa: E402
from moeflux_mlx.benchmark.decode import SkippedExperts  # noqa: E402
from moeflux_mlx.compute import kernels  # noqa: E402


def one_token_at_a_time(model, prompt, tokens):
    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)
    build, encode, wait = [], [], []
    for _ in range(tokens):
        t0 = time.perf_counter()
        logits = model(y[:, None], cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        build.append(t1 - t0), encode.append(t2 - t1), wait.append(t3 - t2)
    return [1e3 * statistics.median(v) for v in (build, encode, wait)]


def pipelined_ms(model, prompt, tokens):
    gen = generate_step(prompt, model, max_tokens=tokens + 1)
    next(gen)
    mx.synchronize()
    t = time.perf_counter()
    for _ in gen:
        pass
    mx.synchronize()
    return 1e3 * (time.perf_counter() - t) / tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--poll-max-us",
        default="",
        help="comma-separated caps: one table model each (else the default cap)",
    )
    args = ap.parse_args()
    mx.random.seed(0)
    prompt = mx.random.randint(0, 256, (128,)).astype(mx.uint32)
    models = {"stock mlx-lm": mlx_lm.load(str(args.model))[0]}
    variants = [("moeflux ops", "ops", None, None), ("moeflux kernels", "auto", None, None)]
    caps = [c for c in args.poll_max_us.split(",") if c]
    variants += [(f"moeflux kernels, table (poll cap {c} us)", "auto", "all", c) for c in caps] or [
        ("moeflux kernels, table", "auto", "all", None)
    ]
    variants.append(("experts skipped", "ops", None, None))
    for name, backend, table, cap in variants:
        env = dict(os.environ)
        if cap is not None:  # read by the miss server process this load starts
            os.environ["MOEFLUX_SERVER_POLL_MAX_US"] = cap
        m, _ = moeflux_mlx.load(args.model, cache_budget="all", backend=backend, device_table=table)
        os.environ.clear()
        os.environ.update(env)
        if (
            backend == "auto"
            and not isinstance(m.moeflux.backend, kernels.KernelBackend)
            or (table and m.moeflux.cache.name != "table")
        ):
            m.moeflux.close()  # no GPU kernels or table here
            continue
        if name == "experts skipped":
            m.moeflux.backend = SkippedExperts()
        models[name] = m
    rows = {k: [] for k in models}
    for m in models.values():
        pipelined_ms(m, prompt, 4)  # warm-up
    for _ in range(args.rounds):
        for k, m in models.items():
            rows[k].append(
                one_token_at_a_time(m, prompt, args.tokens) + [pipelined_ms(m, prompt, args.tokens)]
            )
    print(
        f"{args.model.name}, {mx.default_device()}, MLX {mx.__version__}; medians over "
        f"{args.rounds} rounds of {args.tokens} tokens, ms per token"
    )
    print("| model | build | encode | GPU wait | one at a time | pipelined | x stock (pipelined) |")
    print("|---|---|---|---|---|---|---|")
    stock = statistics.median(r[3] for r in rows["stock mlx-lm"])
    for k, v in rows.items():
        b, e, w, p = (statistics.median(r[i] for r in v) for i in range(4))
        print(
            f"| {k} | {b:.3f} | {e:.3f} | {w:.3f} | {b + e + w:.3f} | {p:.3f} | {stock / p:.2f} |"
        )
    for m in models.values():
        if hasattr(m, "moeflux"):
            m.moeflux.close()


if __name__ == "__main__":
    main()
