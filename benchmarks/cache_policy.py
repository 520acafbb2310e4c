"""Which eviction policy should the expert cache use? Hit rates of LRU (what the cache does) and
the alternatives, replayed on routing traces recorded from a model decoding.

Records, per MoE layer, the experts each decode token is routed to (greedy decode through
moeflux with every expert resident, so any model size works, plain or converted), then replays
each layer's trace through a cache of C slots under each policy, for several budgets:

``lru``     evict the least recently used expert not needed by this token (moeflux's policy)
``lfu``     evict the least frequently used so far (ties: least recently used)
``decay``   evict the lowest exponentially decayed use count (half-lives ``--half-life`` tokens)
``random``  evict a random resident expert not needed now
``opt``     Belady's offline optimum: evict the expert whose next use is farthest away (an upper
            bound no online policy reaches; it shows how much room there is above LRU)

    python benchmarks/cache_policy.py [MODEL] [--tokens 256] [--budgets 0.1,0.25,0.5,0.75]
    python benchmarks/cache_policy.py --traces results/...-cache-policy.json --half-life 8,32,128

Without MODEL it builds a random qwen3_moe (8 layers, 128 experts, top-8, small hidden size).
Random weights route differently from trained ones: measure on the real model to decide.
Prints a table and writes ``<out>/<date>-<machine>-cache-policy.{json,md}``.
"""

import argparse
import datetime
import json
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

POLICIES = ("lru", "lfu", "decay", "random", "opt")


def simulate(trace: Sequence[Sequence[int]], n_slots: int, policy: str, half_life: float = 32.0,
             seed: int = 0) -> int:
    """Hits of one layer's trace (one set of experts per token) through ``n_slots`` slots.
    Every routed expert must be resident for its token: a miss evicts a resident expert that
    this token does not need (the cache's admission rule)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    rng = random.Random(seed)
    resident: set = set()
    last: Dict[int, int] = {}
    count: Dict[int, float] = defaultdict(float)
    decay = 0.5 ** (1.0 / half_life)
    next_use: List[Dict[int, int]] = []
    if policy == "opt":  # for each token, each expert's next use after it
        upcoming: Dict[int, int] = {}
        for t in range(len(trace) - 1, -1, -1):
            next_use.append(dict(upcoming))
            for e in trace[t]:
                upcoming[e] = t
        next_use.reverse()
    hits = 0
    for t, experts in enumerate(trace):
        need = set(int(e) for e in experts)
        if len(need) > n_slots:
            raise ValueError(f"token {t} routes to {len(need)} experts, more than {n_slots} slots")
        hits += len(need & resident)
        for e in sorted(need - resident):
            if len(resident) >= n_slots:
                candidates = sorted(resident - need)
                if policy == "lru":
                    victim = min(candidates, key=lambda c: last[c])
                elif policy in ("lfu", "decay"):
                    victim = min(candidates, key=lambda c: (count[c], last[c]))
                elif policy == "random":
                    victim = rng.choice(candidates)
                else:
                    victim = max(candidates, key=lambda c: next_use[t].get(c, len(trace)))
                resident.discard(victim)
            resident.add(e)
        if policy == "decay":
            for e in list(count):
                count[e] *= decay
        for e in need:
            last[e] = t
            count[e] += 1.0
    return hits


def record_traces(model_path: Path, prompts: List[List[int]], tokens: int) -> Dict[int, list]:
    """layer -> one list of routed experts per decode token (greedy), over all prompts."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import moeflux_mlx
    from moeflux_mlx.module import StreamingSwitchGLU

    model, _ = moeflux_mlx.load(model_path, cache_budget="all", backend="ops")
    traces: Dict[int, list] = defaultdict(list)
    recording = [False]
    original = StreamingSwitchGLU.__call__

    def call(self, x, indices):
        if recording[0] and indices.size == indices.shape[-1]:  # one decode token
            traces[self.layer].append(np.array(indices).reshape(-1).tolist())
        return original(self, x, indices)

    StreamingSwitchGLU.__call__ = call
    try:
        with model.moeflux:
            for prompt in prompts:
                gen = generate_step(mx.array(prompt), model, max_tokens=tokens + 1)
                next(gen)  # the prefill's routing is one bulk fill, not a decode pattern
                recording[0] = True
                for _ in gen:
                    pass
                recording[0] = False
    finally:
        StreamingSwitchGLU.__call__ = original
    return dict(traces)


def columns(half_lives: Sequence[float]) -> List[tuple]:
    """(column name, policy, half-life): one decay column per half-life."""
    cols = [("lru", "lru", 0.0), ("lfu", "lfu", 0.0)]
    cols += [(f"decay {h:g}", "decay", h) for h in half_lives]
    return cols + [("random", "random", 0.0), ("opt", "opt", 0.0)]


def run(traces: Dict[int, list], num_experts: Dict[int, int], budgets: Sequence[float],
        half_lives: Sequence[float]) -> dict:
    rows = []
    for frac in budgets:
        row = {"budget": frac}
        for name, policy, half_life in columns(half_lives):
            hits = routed = 0
            for layer, trace in traces.items():
                top_k = max(len(s) for s in trace)
                n_slots = max(top_k, int(round(frac * num_experts[layer])))
                hits += simulate(trace, n_slots, policy, half_life or 32.0)
                routed += sum(len(s) for s in trace)
            row[name] = hits / routed
        rows.append(row)
    return {"rows": rows, "columns": [c[0] for c in columns(half_lives)], "layers": len(traces),
            "tokens": min(len(t) for t in traces.values()) if traces else 0}


def format_table(result: dict) -> str:
    cols = result["columns"]
    lines = ["| budget | " + " | ".join(cols) + " | opt - lru |", "|---|" + "---|" * (len(cols) + 1)]
    for r in result["rows"]:
        lines.append(f"| {r['budget']:.0%} | " + " | ".join(f"{r[c]:.1%}" for c in cols)
                     + f" | {r['opt'] - r['lru']:+.1%} |")
    return "\n".join(lines)


def main():
    from moeflux_mlx import bench

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--tokens", type=int, default=256, help="decode tokens per prompt")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--budgets", default="0.1,0.25,0.5,0.75")
    ap.add_argument("--half-life", default="32", help="decay half-lives in tokens, comma-separated")
    ap.add_argument("--traces", type=Path, help="replay the traces saved in an earlier result")
    ap.add_argument("--build-dir", type=Path, default=Path(".cache/bench-models"))
    ap.add_argument("--machine", default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    half_lives = [float(h) for h in args.half_life.split(",")]
    budgets = [float(b) for b in args.budgets.split(",")]
    if args.traces is not None:
        saved = json.loads(args.traces.read_text())
        traces = {int(k): v for k, v in saved["traces"].items()}
        num_experts = {int(k): v for k, v in saved["num_experts"].items()}
        model, n_prompts, n_tokens = saved["model"], saved["prompts"], saved["tokens"]
    else:
        model, traces, num_experts = _record(args)
        n_prompts, n_tokens = args.prompts, args.tokens
    result = run(traces, num_experts, budgets, half_lives)
    result.update(model=str(model), machine=bench.machine_name(), half_lives=half_lives,
                  prompts=n_prompts, tokens=n_tokens, num_experts=num_experts,
                  traces={str(k): v for k, v in traces.items()})
    table = format_table(result)
    head = (f"# Expert cache policies: hit rate on {Path(model).name}\n\n"
            f"Machine: {result['machine']}. {result['layers']} MoE layers, {n_prompts} prompts x "
            f"{n_tokens} greedy decode tokens; per layer a cache of budget x experts slots; "
            f"decay half-lives in tokens.\n")
    print(head + "\n" + table)
    tag = args.machine or bench.machine_tag(result["machine"])
    stem = f"{datetime.date.today().isoformat()}-{tag}-cache-policy"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result))
    (args.out / f"{stem}.md").write_text(head + "\n" + table + "\n")
    print(f"wrote {args.out / stem}.{{json,md}}")


def _record(args):
    from moeflux_mlx import synth
    from moeflux_mlx.checkpoint import expert_layout

    model = args.model
    if model is None:
        model = args.build_dir / "qwen3_moe-small-128x8-8l"
        if not model.exists():
            synth.build_checkpoint(model, "qwen3_moe", "small", overrides={
                "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 8})
    layout = expert_layout(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 64).tolist() for _ in range(args.prompts)]
    traces = record_traces(model, prompts, args.tokens)
    return model, traces, {k: v.num_experts for k, v in layout.layers.items()}


if __name__ == "__main__":
    main()
