"""Where one decode token's time goes: building the graph (Python), encoding it (the host side
of ``mx.async_eval``: every primitive's kernels are issued), and waiting for the GPU to finish,
one token at a time without overlap; then the same models decoding pipelined, as mlx-lm does.

Models: stock mlx-lm, moeflux with every expert resident through the plain ops, through the
fused kernels, through the fused kernels with every expert looked up in the device-side table,
and with the experts skipped (the ceiling, see bench.py).
If build + encode is close to the pipelined time per token, decode is bound by the host, and
what counts is how many graph nodes a layer adds, not how fast its kernels run.

    python benchmarks/host_probe.py MODEL [--tokens 64] [--rounds 3]

MODEL: a plain mlx-lm checkpoint (e.g. one ``benchmarks/decode.py`` built).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import moeflux_mlx  # noqa: E402
from moeflux_mlx import kernels  # noqa: E402
from moeflux_mlx.bench import SkippedExperts  # noqa: E402


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
    args = ap.parse_args()
    mx.random.seed(0)
    prompt = mx.random.randint(0, 256, (128,)).astype(mx.uint32)
    models = {"stock mlx-lm": mlx_lm.load(str(args.model))[0]}
    for name, backend, table in (("moeflux ops", "ops", None), ("moeflux kernels", "auto", None),
                                 ("moeflux kernels, table", "auto", "all"),
                                 ("experts skipped", "ops", None)):
        m, _ = moeflux_mlx.load(args.model, cache_budget="all", backend=backend,
                                device_table=table)
        if backend == "auto" and not isinstance(m.moeflux.backend, kernels.KernelBackend) or (
                table and m.moeflux.cache.control is None):
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
            rows[k].append(one_token_at_a_time(m, prompt, args.tokens)
                           + [pipelined_ms(m, prompt, args.tokens)])
    print(f"{args.model.name}, {mx.default_device()}, MLX {mx.__version__}; medians over "
          f"{args.rounds} rounds of {args.tokens} tokens, ms per token")
    print("| model | build | encode | GPU wait | one at a time | pipelined | x stock (pipelined) |")
    print("|---|---|---|---|---|---|---|")
    stock = statistics.median(r[3] for r in rows["stock mlx-lm"])
    for k, v in rows.items():
        b, e, w, p = (statistics.median(r[i] for r in v) for i in range(4))
        print(f"| {k} | {b:.3f} | {e:.3f} | {w:.3f} | {b + e + w:.3f} | {p:.3f} | {stock / p:.2f} |")
    for m in models.values():
        if hasattr(m, "moeflux"):
            m.moeflux.close()


if __name__ == "__main__":
    main()
