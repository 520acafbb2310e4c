"""Which eviction policy suits a model's routing? Measured on routing traces: the experts every
MoE layer routed each token to.

Records (``benchmarks/lib/routing.py``) a model's routing over held-out text, teacher-forced
(one forward pass per ``--context`` tokens, every expert resident; the text's first ``--tokens``
tokens, or with ``--per-document N`` the first N of each document), and over a short greedy
decode from the text's start; saves each as a small trace file (``.npz``: experts as uint8
``[tokens, layers, top_k]``, no hidden states); then reports on each:

- how skewed expert popularity is (top-10% share, normalized entropy, Gini, experts unused);
- reuse: the share of a token's experts the same layer used in the last N tokens;
- eviction: each layer's trace replayed through the package's own policies
  (``moeflux_mlx.cache.policy.POLICIES``: transition, the default, and lru, driven exactly as
  the cache drives them), random eviction and Belady's offline optimum (``opt``, a bound no
  online policy reaches), at each budget: misses per token and the ratio to LRU;
- what a page cache would serve of the default policy's misses (what reading uncached gives up).

    python benchmarks/cache_policy.py [MODEL] [--tokens 4096] [--decode 128]
        [--per-document 256] [--budgets 0.1,0.25,0.5] [--label NAME]
    python benchmarks/cache_policy.py --traces benchmarks/results/traces/...-text.npz [...]

Without MODEL it builds a random-weight qwen3_moe of the demo model's shape (8 layers, 64
experts, top-8, hidden 256, vocabulary 4096: training/train.py's demo preset), so random and
trained routing compare on the same text. Writes the traces and
``<date>-<machine>-<label>-routing.md`` to ``--out`` (``benchmarks/results/traces``).
"""

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.lib.routing import (  # noqa: E402
    RoutingTrace,
    analyze,
    format_prompt_learning,
    format_report,
    prompt_learning_table,
)
from moeflux_mlx.measure import machine_name, machine_tag  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = ROOT / "training" / "data" / "tokens-test.npy"
# training/train.py's demo preset, as config.json overrides of synth's qwen3_moe
DEMO_SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 128,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
}


def _floats(text: str) -> List[float]:
    return [float(v) for v in text.split(",") if v]


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v]


def random_model(build_dir: Path) -> Path:
    """The random-weight demo-shaped qwen3_moe (4-bit, like the trained model's export).

    Args:
        build_dir: where it is built, once.

    Returns:
        Its checkpoint folder.
    """
    from tests.support import synth

    path = build_dir / "qwen3_moe-demo-shape-random"
    if not (path / "config.json").exists():
        synth.build_checkpoint(path, "qwen3_moe", "small", overrides=DEMO_SHAPE)
    return path


def text_tokens(path: Path, skip: int, count: int, per_document: int) -> tuple:
    """The text to record.

    Args:
        path: token ids (``.npy``; with ``per_document``, the ``.json`` beside it gives the
            documents' boundaries, as ``training/data`` has them).
        skip: the first token (or, with ``per_document``, document) to take.
        count: how many tokens.
        per_document: at most this many tokens of each document (0: the text as it is).

    Returns:
        ``(token ids, a line saying which)``.
    """
    ids = np.load(path)
    if not per_document:
        tokens = ids[skip : skip + count].astype(np.int64)
        return tokens, f"{path.name}[{skip}:{skip + tokens.size}]"
    docs = json.loads(path.with_suffix(".json").read_text())["documents"]
    parts, total, last = [], 0, skip
    for i, (start, n) in enumerate(zip(docs["start"], docs["tokens"])):
        if i < skip or total >= count:
            continue
        part = ids[start : start + min(n, per_document, count - total)]
        parts.append(part)
        total += part.size
        last = i
    tokens = np.concatenate(parts).astype(np.int64)
    return tokens, f"{path.name}: the first {per_document} tokens of documents {skip}-{last}"


def record(args, label: str, stem: str) -> List[RoutingTrace]:
    """Record the text (and decode) traces of ``args.model`` and save them under ``args.out``.

    Args:
        args: the parsed command line.
        label: the run's name (in the traces' meta).
        stem: the trace files' name before ``-text.npz`` / ``-decode.npz``.

    Returns:
        The traces: the text's, then the decode's if any.
    """
    from benchmarks.lib.routing import record_text

    model = args.model if args.model is not None else random_model(args.build_dir)
    try:  # the result files name a model in the checkout by its path in the checkout
        shown = str(model.resolve().relative_to(ROOT))
    except ValueError:
        shown = str(model)
    tokens, source = text_tokens(args.text, args.skip, args.tokens, args.per_document)
    text, dec = record_text(
        model,
        tokens,
        context=args.context,
        decode=args.decode,
        prompt_tokens=args.prompt_tokens,
        meta={
            "label": label,
            "model": shown,
            "source": source,
        },
    )
    out = [text] + ([dec] if dec is not None else [])
    for trace, kind in zip(out, ("text", "decode")):
        path = trace.save(args.out / f"{stem}-{kind}.npz")
        print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")
    return out


def main(argv=None) -> int:
    """Record (or load) the traces, report on them, write the report.

    Args:
        argv: the command line (default: ``sys.argv[1:]``).

    Returns:
        The exit status (0).
    """
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model", nargs="?", type=Path, help="a checkpoint (default: random model)")
    ap.add_argument("--traces", type=Path, nargs="+", help="report on saved traces instead")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="token ids (.npy)")
    ap.add_argument("--skip", type=int, default=0, help="start this many tokens (or documents) in")
    ap.add_argument(
        "--per-document", type=int, default=0, help="take at most this many tokens a document"
    )
    ap.add_argument("--tokens", type=int, default=4096, help="text tokens to record")
    ap.add_argument("--context", type=int, default=512, help="tokens per forward pass")
    ap.add_argument("--decode", type=int, default=128, help="greedy decode tokens (0: none)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="the decode's prompt")
    ap.add_argument("--budgets", default="0.1,0.25,0.5", help="fractions of each layer's experts")
    ap.add_argument("--windows", default="1,2,4,8,12,16", help="reuse windows in tokens")
    ap.add_argument(
        "--prompt-learning",
        default=None,
        metavar="PROMPT:DECODE",
        help="also replay decode windows of DECODE tokens after PROMPT tokens the policies "
        "learn from first (as a whole-layer prefill teaches them), at 25%%, e.g. 128:512",
    )
    ap.add_argument("--label", default=None, help="names the files (default: model folder)")
    ap.add_argument("--build-dir", type=Path, default=ROOT / ".cache" / "bench-models")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "traces")
    args = ap.parse_args(argv)

    machine = machine_name()
    tag = args.machine or machine_tag(machine)
    date = datetime.date.today().isoformat()
    if args.traces:
        traces = [RoutingTrace.load(p) for p in args.traces]
        label = args.label or args.traces[0].stem
    else:
        label = args.label or (args.model.name if args.model is not None else "random")
        args.out.mkdir(parents=True, exist_ok=True)
        traces = record(args, label, f"{date}-{label}")
    sections = []
    for trace in traces:
        result = analyze(trace, budgets=_floats(args.budgets), windows=_ints(args.windows))
        sections.append(f"## {trace.meta.get('mode', 'trace')}\n\n" + format_report(result))
        if args.prompt_learning:
            p, d = (int(v) for v in args.prompt_learning.split(":"))
            learnt = prompt_learning_table(trace, prompt_tokens=p, decode_tokens=d)
            sections.append("### Policies taught the prompt\n\n" + format_prompt_learning(learnt))
    body = (
        f"# Routing and caching: {label}\n\nMachine: {machine}. "
        f"`benchmarks/cache_policy.py`.\n\n" + "\n\n".join(sections) + "\n"
    )
    print(body)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{date}-{tag}-{label}-routing.md"
    path.write_text(body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
