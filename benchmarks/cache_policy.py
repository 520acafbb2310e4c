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

It also measures two prefetch predictors, through the LRU cache: the same layer's
experts of the previous token, and the next layer's router applied to this layer's MoE input
(what ``prefetch=True`` reads ahead), recorded beside the routing: each one's recall, the share
of the cache's misses it would have read ahead, and the reads it would waste per token.

    python benchmarks/cache_policy.py [MODEL] [--tokens 256] [--budgets 0.1,0.25,0.5,0.75]
    python benchmarks/cache_policy.py --traces benchmarks/results/...-cache-policy.json --half-life 8,32,128

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
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

POLICIES = ("lru", "lfu", "decay", "random", "opt")


def replay(
    trace: Sequence[Sequence[int]],
    n_slots: int,
    policy: str,
    half_life: float = 32.0,
    seed: int = 0,
):
    """Replay one layer's trace (one set of experts per token) through ``n_slots`` slots; yields
    ``(need, resident)`` per token: the experts it routes to and those resident before it.
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
    for t, experts in enumerate(trace):
        need = set(int(e) for e in experts)
        if len(need) > n_slots:
            raise ValueError(f"token {t} routes to {len(need)} experts, more than {n_slots} slots")
        yield need, frozenset(resident)
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


def simulate(
    trace: Sequence[Sequence[int]],
    n_slots: int,
    policy: str,
    half_life: float = 32.0,
    seed: int = 0,
) -> int:
    """Hits of one layer's trace through ``n_slots`` slots under ``policy`` (see ``replay``)."""
    return sum(
        len(need & resident) for need, resident in replay(trace, n_slots, policy, half_life, seed)
    )


def predictor_sets(
    trace: Sequence[Sequence[int]], gate_predicted: Optional[Sequence[Sequence[int]]]
) -> Dict[str, List[set]]:
    """Per predictor, the experts it names for each token of one layer: the same layer's experts
    of the previous token, the next-layer gate (this layer's router applied to the previous MoE
    layer's input: what ``prefetch=True`` reads ahead), and both together."""
    previous = [set()] + [set(s) for s in trace[:-1]]
    out = {"previous token": previous}
    if gate_predicted is not None:
        gate = [set(s) for s in gate_predicted]
        out["next-layer gate"] = gate
        out["both"] = [a | b for a, b in zip(previous, gate)]
    return out


def prefetch_coverage(
    trace: Sequence[Sequence[int]], predicted: Dict[str, List[set]], n_slots: int
) -> dict:
    """Through an LRU cache of ``n_slots`` (what moeflux keeps; a prefetch reads into buffers of
    its own and does not change it): routed experts, misses, and per predictor the misses it
    would have read ahead (``covered``) and the absent experts it would have read for nothing
    (``wasted``): prefetch pays only on misses, and its wasted reads compete with them."""
    out = {"routed": 0, "misses": 0, "tokens": len(trace)}
    for name in predicted:
        out[name] = {"covered": 0, "wasted": 0}
    for t, (need, resident) in enumerate(replay(trace, n_slots, "lru")):
        miss = need - resident
        out["routed"] += len(need)
        out["misses"] += len(miss)
        for name, sets in predicted.items():
            ahead = sets[t] - resident
            out[name]["covered"] += len(ahead & miss)
            out[name]["wasted"] += len(ahead - need)
    return out


def record_traces(model_path: Path, prompts: List[List[int]], tokens: int):
    """Greedy decode of each prompt; returns ``(traces, gate_predicted)``: layer -> one list of
    routed experts per decode token, and layer -> the experts its router picks for the previous
    MoE layer's input at the same token (the next-layer-gate prediction ``prefetch=True`` uses;
    the first MoE layer has none)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import moeflux_mlx
    from moeflux_mlx.model.predict import next_gates, predict_experts
    from moeflux_mlx.model.switch import StreamingSwitchGLU

    model, _ = moeflux_mlx.load(model_path, cache_budget="all", backend="ops")
    gates = next_gates(model, model.moeflux.layout.module_paths)  # layer -> (next layer, router)
    traces: Dict[int, list] = defaultdict(list)
    gate_predicted: Dict[int, list] = defaultdict(list)
    recording = [False]
    original = StreamingSwitchGLU.__call__

    def call(self, x, indices):
        if recording[0] and indices.size == indices.shape[-1]:  # one decode token
            traces[self.layer].append(np.array(indices).reshape(-1).tolist())
            ahead = gates.get(self.layer)
            if ahead is not None:
                predicted = predict_experts(ahead[1], x, indices.shape[-1])
                gate_predicted[ahead[0]].append(np.array(predicted).reshape(-1).tolist())
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
    return dict(traces), dict(gate_predicted)


def columns(half_lives: Sequence[float]) -> List[tuple]:
    """(column name, policy, half-life): one decay column per half-life."""
    cols = [("lru", "lru", 0.0), ("lfu", "lfu", 0.0)]
    cols += [(f"decay {h:g}", "decay", h) for h in half_lives]
    return cols + [("random", "random", 0.0), ("opt", "opt", 0.0)]


def _slots(trace, frac: float, num_experts: int) -> int:
    return max(max(len(s) for s in trace), int(round(frac * num_experts)))


def run(
    traces: Dict[int, list],
    num_experts: Dict[int, int],
    budgets: Sequence[float],
    half_lives: Sequence[float],
) -> dict:
    rows = []
    for frac in budgets:
        row = {"budget": frac}
        for name, policy, half_life in columns(half_lives):
            hits = routed = 0
            for layer, trace in traces.items():
                hits += simulate(
                    trace, _slots(trace, frac, num_experts[layer]), policy, half_life or 32.0
                )
                routed += sum(len(s) for s in trace)
            row[name] = hits / routed
        rows.append(row)
    return {
        "rows": rows,
        "columns": [c[0] for c in columns(half_lives)],
        "layers": len(traces),
        "tokens": min(len(t) for t in traces.values()) if traces else 0,
    }


def format_table(result: dict) -> str:
    cols = result["columns"]
    lines = [
        "| budget | " + " | ".join(cols) + " | opt - lru |",
        "|---|" + "---|" * (len(cols) + 1),
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['budget']:.0%} | "
            + " | ".join(f"{r[c]:.1%}" for c in cols)
            + f" | {r['opt'] - r['lru']:+.1%} |"
        )
    return "\n".join(lines)


def run_prefetch(
    traces: Dict[int, list],
    gate_predicted: Dict[int, list],
    num_experts: Dict[int, int],
    budgets: Sequence[float],
) -> dict:
    """Each predictor's recall (routed experts it named) and, per budget, the share of LRU's
    misses it would have read ahead and its wasted reads per token. Over the layers that have
    a next-layer-gate prediction (every MoE layer but the first), so predictors compare."""
    layers = sorted(gate_predicted) or sorted(traces)
    sets = {layer: predictor_sets(traces[layer], gate_predicted.get(layer)) for layer in layers}
    names = list(sets[layers[0]]) if layers else []
    routed = sum(len(s) for layer in layers for s in traces[layer])
    recall = {
        n: sum(len(p & set(r)) for layer in layers for p, r in zip(sets[layer][n], traces[layer]))
        / max(routed, 1)
        for n in names
    }
    rows = []
    for frac in budgets:
        per = [
            prefetch_coverage(
                traces[layer], sets[layer], _slots(traces[layer], frac, num_experts[layer])
            )
            for layer in layers
        ]
        misses = sum(c["misses"] for c in per)
        tokens = per[0]["tokens"] if per else 0
        row = {"budget": frac, "misses_per_token": misses / max(tokens, 1)}
        for n in names:
            row[n] = {
                "covered": sum(c[n]["covered"] for c in per) / max(misses, 1),
                "wasted_per_token": sum(c[n]["wasted"] for c in per) / max(tokens, 1),
            }
        rows.append(row)
    return {"layers": layers, "predictors": names, "recall": recall, "rows": rows}


def format_prefetch(result: dict) -> str:
    names = result["predictors"]
    recall = ", ".join(f"{n} {result['recall'][n]:.1%}" for n in names)
    lines = [
        f"Recall (routed experts the predictor named): {recall}.",
        "",
        "| budget | misses/tok | "
        + " | ".join(f"{n}: misses covered | {n}: wasted reads/tok" for n in names)
        + " |",
        "|---|---|" + "---|---|" * len(names),
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['budget']:.0%} | {r['misses_per_token']:.2f} | "
            + " | ".join(f"{r[n]['covered']:.1%} | {r[n]['wasted_per_token']:.2f}" for n in names)
            + " |"
        )
    return "\n".join(lines)


def main():
    from moeflux_mlx.benchmark import report

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        gate_predicted = {int(k): v for k, v in saved.get("gate_predicted", {}).items()}
        model, n_prompts, n_tokens = saved["model"], saved["prompts"], saved["tokens"]
    else:
        model, traces, gate_predicted, num_experts = _record(args)
        n_prompts, n_tokens = args.prompts, args.tokens
    result = run(traces, num_experts, budgets, half_lives)
    result.update(
        model=str(model),
        machine=report.machine_name(),
        half_lives=half_lives,
        prompts=n_prompts,
        tokens=n_tokens,
        num_experts=num_experts,
        traces={str(k): v for k, v in traces.items()},
        gate_predicted={str(k): v for k, v in gate_predicted.items()},
    )
    result["prefetch"] = run_prefetch(traces, gate_predicted, num_experts, budgets)
    table = format_table(result)
    head = (
        f"# Expert cache policies: hit rate on {Path(model).name}\n\n"
        f"Machine: {result['machine']}. {result['layers']} MoE layers, {n_prompts} prompts x "
        f"{n_tokens} greedy decode tokens; per layer a cache of budget x experts slots; "
        f"decay half-lives in tokens.\n"
    )
    pf = result["prefetch"]
    table += (
        (
            "\n\n## Prefetch predictors, through the LRU cache\n\n"
            f"Over MoE layers {pf['layers'][0]}-{pf['layers'][-1]} (the first has no previous "
            "layer to predict it from). A predictor's reads go to buffers of their own (the "
            "cache evolves as without prefetch); it covers a miss it named, and wastes a read on "
            "an absent expert it named that the router did not pick.\n\n" + format_prefetch(pf)
        )
        if pf["layers"]
        else ""
    )
    print(head + "\n" + table)
    tag = args.machine or report.machine_tag(result["machine"])
    stem = f"{datetime.date.today().isoformat()}-{tag}-cache-policy"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result))
    (args.out / f"{stem}.md").write_text(head + "\n" + table + "\n")
    print(f"wrote {args.out / stem}.{{json,md}}")


def _record(args):
    from moeflux_mlx.format.checkpoint import expert_layout
    from moeflux_mlx.testing import synth

    model = args.model
    if model is None:
        model = args.build_dir / "qwen3_moe-small-128x8-8l"
        if not model.exists():
            synth.build_checkpoint(
                model,
                "qwen3_moe",
                "small",
                overrides={"num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 8},
            )
    layout = expert_layout(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 64).tolist() for _ in range(args.prompts)]
    traces, gate_predicted = record_traces(model, prompts, args.tokens)
    return model, traces, gate_predicted, {k: v.num_experts for k, v in layout.layers.items()}


if __name__ == "__main__":
    main()
