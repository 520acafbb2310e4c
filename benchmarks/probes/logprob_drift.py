"""How far is each way of running a model from float32, decoding the same tokens?

On a GPU the fused expert kernels round in another order than stock mlx-lm, so ``compare``'s
log-probs differ although the tokens agree. This probe tells rounding noise from a bug: every
variant decodes the same forced tokens (stock bf16's greedy continuation) one at a time, after
the same prefill, and its log-probs are compared with the model cast to float32:

``stock``      mlx_lm.load as shipped (bf16 activations)
``stock-cpu``  the same on the CPU (another machine's rounding, for scale)
``ops``        moeflux_mlx.load, backend ops (gather_qmm: must equal stock exactly)
``kernels``    moeflux_mlx.load, backend auto (the fused kernels where a GPU has them)

A variant as far from float32 as stock is, is as accurate as stock; its distance to stock is
then rounding noise. Columns: KL(float32 || variant) mean and max over steps (nats), the largest
|Δ log-prob| over the whole vocabulary and over the tokens float32 gives log-prob > -5, and the
steps whose argmax differs from float32's.

    python benchmarks/probes/logprob_drift.py [MODEL] [--tokens 48] [--prompt TEXT ...]
"""

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import moeflux_mlx  # noqa: E402
from moeflux_mlx import demo_model  # noqa: E402

PROMPTS = (
    "Tell me something wise.",
    'What does "harbor" mean?',
    "Continue this story: It is a truth universally acknowledged",
)


def decode_forced(model, prompt, forced, device):
    """Log-probs (float64, [steps, vocab]) of each forced step, after a prefill of ``prompt``."""
    with mx.stream(device):
        cache = make_prompt_cache(model)
        logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
        out = []
        for tok in forced:
            lg = logits.astype(mx.float32)
            out.append(np.array(lg - mx.logsumexp(lg), dtype=np.float64))
            logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        return np.stack(out)


def greedy_tokens(model, prompt, n):
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    toks = []
    for _ in range(n):
        tok = int(mx.argmax(logits))
        toks.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return toks


def metrics(ref, got):
    p = np.exp(ref)
    kl = (p * (ref - got)).sum(-1)
    d = np.abs(ref - got)
    likely = ref > -5
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "dlp_all": float(d.max()),
        "dlp_likely": float(d[likely].max()),
        "argmax_diff": int((ref.argmax(-1) != got.argmax(-1)).sum()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt", action="append", default=None)
    args = ap.parse_args()
    path = Path(args.model) if args.model else demo_model.checkpoint_path()
    gpu = mx.default_device() == mx.gpu

    stock, tok = mlx_load(str(path))
    ref32, _ = mlx_load(str(path))
    ref32.set_dtype(mx.float32)  # activations, norms and quantization scales in float32
    variants = {"stock": (stock, mx.default_device())}
    if gpu:
        variants["stock-cpu"] = (stock, mx.cpu)
    variants["ops"] = (moeflux_mlx.load(path, backend="ops")[0], mx.default_device())
    if gpu:
        variants["kernels"] = (moeflux_mlx.load(path, backend="auto")[0], mx.default_device())

    rows = {name: [] for name in variants}
    vs_stock = {name: [] for name in variants}
    for text in args.prompt or PROMPTS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        forced = greedy_tokens(stock, prompt, args.tokens)
        ref = decode_forced(ref32, prompt, forced, mx.default_device())
        base = decode_forced(stock, prompt, forced, mx.default_device())
        for name, (model, device) in variants.items():
            got = base if name == "stock" else decode_forced(model, prompt, forced, device)
            rows[name].append(metrics(ref, got))
            vs_stock[name].append(metrics(base, got))

    print(f"model {path}, device {mx.default_device()}, {args.tokens} forced tokens per prompt")
    print(
        "| variant | KL vs fp32 mean | KL max | max |Δlp| all | max |Δlp| (lp>-5) | argmax ≠ fp32 "
        "| max |Δlp| vs stock, all | (lp>-5) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in variants:
        r, s = rows[name], vs_stock[name]
        print(
            f"| {name} | {np.mean([x['kl_mean'] for x in r]):.2e} "
            f"| {max(x['kl_max'] for x in r):.2e} | {max(x['dlp_all'] for x in r):.3f} "
            f"| {max(x['dlp_likely'] for x in r):.3f} | {sum(x['argmax_diff'] for x in r)} "
            f"| {max(x['dlp_all'] for x in s):.3f} | {max(x['dlp_likely'] for x in s):.3f} |"
        )


if __name__ == "__main__":
    main()
