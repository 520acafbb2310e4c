"""Routing traces and what they say about caching experts (``benchmarks/cache_policy.py``).

A ``RoutingTrace`` holds the experts every MoE layer routed each token to (``[tokens, layers,
top_k]``), recorded from any model ``moeflux_mlx.load`` opens (``record_text``: forward passes over a
text, teacher-forced, and optionally a greedy decode). Hidden states are never stored: a trace is
a few hundred kB (``save`` / ``load``). Traces recorded while the package still prefetched also
hold predictions of the next layer's experts (``predicted``); they are kept as stored, for
``trace_routing``'s replays, and no longer recorded or scored here.

From a trace, with numpy only:

- ``replay``: one layer's routing through the package's own eviction policies
  (``cache.policy.POLICIES``: transition and LRU, driven as the cache's ``PolicyBook`` drives
  them), plus ``BeladyPolicy`` (the offline optimum, an upper bound) and ``RandomPolicy``:
  misses per token.
- ``window_scores`` / ``reuse_table``: how many of a token's experts the last N tokens used.
- ``skew``: how unevenly the experts are used (top-10% share, normalized entropy, Gini).
- ``analyze`` / ``format_report``: all of it, as the benchmark prints it.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from moeflux_mlx.cache.policy import POLICIES, EvictionPolicy, LRUPolicy
from moeflux_mlx.model.load import load
from moeflux_mlx.model.switch import StreamingSwitchGLU

TRACE_VERSION = 1


# ---------------------------------------------------------------------------------- the trace


@dataclass
class RoutingTrace:
    """The routed experts of every MoE layer for every token of one recording.

    Attributes:
        routed: ``[tokens, layers, top_k]`` expert indices.
        layers: the MoE layers' decoder-layer indices, in order (``routed``'s axis 1).
        num_experts: experts per MoE layer (same order).
        tokens: the input token id at each position (``[tokens]``; -1 where unknown).
        predicted: name -> ``[tokens - eval_from, len(pred_layers), m]`` ranked predictions
            (best first) of ``pred_layers``' experts for tokens ``eval_from`` onwards, in traces
            recorded with them (none are recorded now).
        pred_layers: the layers predicted (each from the MoE layer before it).
        eval_from: the first token a stored predictor was not fitted on.
        meta: how it was recorded (model, text, mode, context, ...).
    """

    routed: np.ndarray
    layers: List[int]
    num_experts: List[int]
    tokens: np.ndarray
    predicted: Dict[str, np.ndarray] = field(default_factory=dict)
    pred_layers: List[int] = field(default_factory=list)
    eval_from: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def top_k(self) -> int:
        return int(self.routed.shape[2])

    def layer(self, layer: int) -> np.ndarray:
        """One MoE layer's routing.

        Args:
            layer: its decoder-layer index (one of ``layers``).

        Returns:
            ``[tokens, top_k]`` routed experts.

        Raises:
            ValueError: the trace has no such layer.
        """
        return self.routed[:, self.layers.index(layer)]

    def save(self, path: Union[str, Path]) -> Path:
        """Write the trace as a compressed ``.npz`` (experts as uint8 where they fit).

        Args:
            path: the file (``.npz`` is appended by numpy if missing).

        Returns:
            The path written.
        """
        small = max(self.num_experts) <= 256
        dtype = np.uint8 if small else np.uint16
        arrays = {
            "routed": self.routed.astype(dtype),
            "layers": np.array(self.layers, np.int32),
            "num_experts": np.array(self.num_experts, np.int32),
            "tokens": self.tokens.astype(np.int32),
            "pred_layers": np.array(self.pred_layers, np.int32),
            "eval_from": np.array(self.eval_from, np.int64),
            "meta": np.array(json.dumps({**self.meta, "trace_version": TRACE_VERSION})),
        }
        for name, pred in self.predicted.items():
            arrays[f"pred_{name}"] = pred.astype(dtype)
        path = Path(path)
        np.savez_compressed(path, **arrays)
        return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")

    @classmethod
    def load(cls, path: Union[str, Path]) -> RoutingTrace:
        """Read a trace written by ``save``, or the routing saved in an older
        ``*-cache-policy.json`` result (decode traces, and the next-layer gate's top-k).

        Args:
            path: a ``.npz`` or ``.json`` file.

        Returns:
            The trace.

        Raises:
            ValueError: the file holds no routing trace, or one of another version.
        """
        path = Path(path)
        if path.suffix == ".json":
            return cls._from_json(json.loads(path.read_text()), path)
        with np.load(path, allow_pickle=False) as z:
            if "routed" not in z.files:
                raise ValueError(f"{path}: not a routing trace (no 'routed' array)")
            meta = json.loads(str(z["meta"]))
            if meta.get("trace_version") != TRACE_VERSION:
                raise ValueError(f"{path}: trace version {meta.get('trace_version')!r}")
            predicted = {
                f[len("pred_") :]: z[f].astype(np.int64)
                for f in z.files
                if f.startswith("pred_") and f != "pred_layers"
            }
            return cls(
                routed=z["routed"].astype(np.int64),
                layers=z["layers"].tolist(),
                num_experts=z["num_experts"].tolist(),
                tokens=z["tokens"].astype(np.int64),
                predicted=predicted,
                pred_layers=z["pred_layers"].tolist() if "pred_layers" in z.files else [],
                eval_from=int(z["eval_from"]) if "eval_from" in z.files else 0,
                meta=meta,
            )

    @classmethod
    def _from_json(cls, saved: dict, path: Path) -> RoutingTrace:
        if "traces" not in saved:
            raise ValueError(f"{path}: no 'traces' in this result file")
        layers = sorted(int(k) for k in saved["traces"])
        routed = np.stack([np.array(saved["traces"][str(i)], np.int64) for i in layers], axis=1)
        gate = saved.get("gate_predicted", {})
        pred_layers = [i for i in layers if str(i) in gate]
        predicted = {}
        if pred_layers:
            predicted["gate"] = np.stack(
                [np.array(gate[str(i)], np.int64) for i in pred_layers], axis=1
            )
        return cls(
            routed=routed,
            layers=layers,
            num_experts=[int(saved["num_experts"][str(i)]) for i in layers],
            tokens=np.full(routed.shape[0], -1, np.int64),
            predicted=predicted,
            pred_layers=pred_layers,
            meta={"model": saved.get("model"), "mode": "decode", "source": str(path)},
        )


# ------------------------------------------------------------------------ replay of policies


class BeladyPolicy(LRUPolicy):
    """Belady's offline optimum: free the resident experts whose next use is farthest away.
    It reads the future, so it is a bound for the online policies, not one of them.

    Args:
        num_experts, n_slots: as every policy.
        trace: ``[calls, k]`` the layer's routed experts; call ``t`` is admitted at tick
            ``t + 1`` (as ``replay`` does).
    """

    name = "opt"

    def __init__(self, num_experts: int, n_slots: int, trace: np.ndarray):
        super().__init__(num_experts, n_slots)
        calls = len(trace)
        # next_use[t, e]: the first tick after tick t at which e is used (calls + 1: never)
        self.next_use = np.full((calls + 2, num_experts), calls + 1, np.int64)
        for t in range(calls, 0, -1):
            self.next_use[t - 1] = self.next_use[t]
            self.next_use[t - 1, trace[t - 1]] = t

    def victims(self, n: int) -> np.ndarray:
        resident = self.expert_in >= 0
        far = np.full(self.expert_in.size, np.iinfo(np.int64).max)  # free slots first
        far[resident] = -self.next_use[self.now, self.expert_in[resident]]
        far[self.last_used == self.now] = np.iinfo(np.int64).max - 1  # this call's stay
        far[~resident] = np.iinfo(np.int64).min
        return np.argsort(far, kind="stable")[:n]


class RandomPolicy(LRUPolicy):
    """Free slots first, then random slots this call does not use (a floor for the others)."""

    name = "random"

    def __init__(self, num_experts: int, n_slots: int, seed: int = 0):
        super().__init__(num_experts, n_slots)
        self.rng = np.random.default_rng(seed)

    def victims(self, n: int) -> np.ndarray:
        free = np.flatnonzero(self.expert_in < 0)[:n]
        if free.size == n:
            return free
        others = np.flatnonzero((self.expert_in >= 0) & (self.last_used != self.now))
        return np.concatenate([free, self.rng.choice(others, n - free.size, replace=False)])


PolicyFactory = Callable[[int, int, np.ndarray], EvictionPolicy]


def policy_factories() -> Dict[str, PolicyFactory]:
    """The replayed policies by column name: every one of ``cache.policy.POLICIES``
    (``transition``, ``lru``), ``random`` and ``opt`` (Belady).

    Returns:
        name -> ``factory(num_experts, n_slots, trace)``.
    """
    out: Dict[str, PolicyFactory] = {}
    for name, cls in POLICIES.items():
        out[name] = lambda e, s, t, cls=cls: cls(e, s)
    out["random"] = lambda e, s, t: RandomPolicy(e, s)
    out["opt"] = lambda e, s, t: BeladyPolicy(e, s, t)
    return out


def replay(
    trace: np.ndarray, num_experts: int, n_slots: int, policy: EvictionPolicy
) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Drive ``policy`` through one layer's trace as the cache's ``PolicyBook`` does: one call per token,
    ticks counted from 1, ``admit`` then ``assign``.

    Args:
        trace: ``[tokens, k]`` routed experts.
        num_experts: the layer's experts (for the resident mask).
        n_slots: the policy's slots (at least ``k``).
        policy: a fresh policy of ``num_experts`` x ``n_slots``.

    Yields:
        ``(experts, missing, resident_before)`` per token: its unique experts, those it missed,
        and the ``[num_experts]`` mask of experts resident before it.

    Raises:
        ValueError: a token routes to more experts than there are slots.
    """
    for tick, row in enumerate(trace, start=1):
        experts = np.unique(row)
        if experts.size > n_slots:
            raise ValueError(
                f"token {tick - 1} routes to {experts.size} experts, more than {n_slots} slots"
            )
        resident = policy.slot_of[:num_experts] >= 0
        missing, victims = policy.admit(experts, tick)
        policy.assign(missing, victims, tick)
        yield experts, missing, resident


def misses(trace: np.ndarray, num_experts: int, n_slots: int, factory: PolicyFactory) -> int:
    """Misses of one layer's trace through ``n_slots`` slots under one policy (see ``replay``).

    Args:
        trace: ``[tokens, k]`` routed experts.
        num_experts: the layer's experts.
        n_slots: slots.
        factory: from ``policy_factories``.

    Returns:
        The number of experts read.
    """
    policy = factory(num_experts, n_slots, trace)
    return sum(m.size for _, m, _ in replay(trace, num_experts, n_slots, policy))


def budget_slots(frac: float, num_experts: int, top_k: int) -> int:
    """Slots for a budget fraction: ``round(frac * experts)``, at least ``top_k`` (a token's
    experts must all be resident at once; the cache stages larger calls uncached).

    Args:
        frac: the budget, a fraction of the layer's experts.
        num_experts: the layer's experts.
        top_k: experts per token.

    Returns:
        The number of slots, at most ``num_experts``.
    """
    return min(num_experts, max(top_k, int(round(frac * num_experts))))


def replay_table(trace: RoutingTrace, budgets: Sequence[float]) -> dict:
    """Misses per token (every MoE layer's summed) per policy and budget, over the whole trace
    from a cold cache.

    Args:
        trace: the recording.
        budgets: fractions of each layer's experts.

    Returns:
        ``{"columns": [...], "rows": [{"budget", "slots", name: misses per token, ...}]}``.
    """
    factories = policy_factories()
    columns = list(factories)
    tokens = max(trace.routed.shape[0], 1)
    rows = []
    for frac in budgets:
        slots = [budget_slots(frac, e, trace.top_k) for e in trace.num_experts]
        per_layer = {
            name: [
                misses(trace.routed[:, i], e, s, factory)
                for i, (e, s) in enumerate(zip(trace.num_experts, slots))
            ]
            for name, factory in factories.items()
        }
        row: dict = {"budget": frac, "slots": slots}
        row.update({name: sum(m) / tokens for name, m in per_layer.items()})
        rows.append(row)
    return {"columns": columns, "rows": rows, "tokens": tokens}


def prompt_learning_table(
    trace: RoutingTrace,
    budget: float = 0.25,
    policies: Sequence[str] = ("transition",),
    prompt_tokens: int = 128,
    decode_tokens: int = 512,
    step: int = 333,
) -> dict:
    """What a prefill's routing teaches a policy (``EvictionPolicy.observe``, which a
    whole-layer prefill always calls): misses of a decode window from empty slots, as a share
    of LRU's, with the policy fresh and after observing the window's prompt, over windows of the
    trace (``prompt_tokens`` rows observed, then ``decode_tokens`` rows replayed, as
    ``benchmarks/decode.py`` with ``--routing-trace`` runs it), every ``step`` tokens from 0.

    Args:
        trace: the recording.
        budget: a fraction of each layer's experts.
        policies: ``cache.policy.POLICIES`` names.
        prompt_tokens, decode_tokens: a window's prompt and decode.
        step: tokens between windows.

    Returns:
        ``{"rows": [{"start", "LRU", name: ratio, name + " learnt": ratio, ...}], "pooled":
        {...}, "columns": [...]}``: LRU's misses and each ratio per window, and the ratios of
        the summed misses.
    """
    span = prompt_tokens + decode_tokens
    starts = list(range(0, trace.routed.shape[0] - span + 1, step))
    rows, totals = [], {}
    for start in starts:
        prompt = trace.routed[start : start + prompt_tokens]
        decode = trace.routed[start + prompt_tokens : start + span]
        row: dict = {"start": start}
        runs = [("LRU", "lru", False)]
        runs += [(f"{p}{tag}", p, bool(tag)) for p in policies for tag in ("", " learnt")]
        for name, policy_name, learn in runs:
            cls = POLICIES[policy_name]
            missed = 0
            for i, e in enumerate(trace.num_experts):
                policy = cls(e, budget_slots(budget, e, trace.top_k))
                if learn:
                    policy.observe(prompt[:, i], 1)
                first = prompt_tokens + 1  # the decode's ticks follow the prompt's
                for tick, experts in enumerate(decode[:, i], start=first):
                    missing, victims = policy.admit(np.unique(experts), tick)
                    policy.assign(missing, victims, tick)
                    missed += missing.size
            row[name] = missed
            totals[name] = totals.get(name, 0) + missed
        rows.append(row)
    names = [n for n in totals if n != "LRU"]
    for row in rows:
        for n in names:
            row[n] = row[n] / row["LRU"]
    pooled = {n: totals[n] / totals["LRU"] for n in names}
    return {
        "budget": budget,
        "prompt": prompt_tokens,
        "decode": decode_tokens,
        "rows": rows,
        "pooled": pooled,
        "columns": names,
    }


def format_prompt_learning(result: dict) -> str:
    """``prompt_learning_table``'s result as a markdown table."""
    cols = result["columns"]
    head = "| window start | LRU misses | " + " | ".join(f"{c} (x LRU)" for c in cols) + " |"
    out = [
        f"Budget {result['budget']:.0%}; each window observes {result['prompt']} prompt rows "
        f'(the "learnt" columns) and replays {result["decode"]} decode rows from empty slots.',
        "",
        head,
        "|" + "---|" * (len(cols) + 2),
    ]
    for r in result["rows"]:
        out.append(
            f"| {r['start']} | {r['LRU']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |"
        )
    out.append(
        "| all, summed | - | " + " | ".join(f"{result['pooled'][c]:.3f}" for c in cols) + " |"
    )
    return "\n".join(out)


# ------------------------------------------------------------------------- reading uncached


def page_cache_table(
    trace: RoutingTrace,
    budget: float = 0.25,
    fractions: Sequence[float] = (0.1, 0.2, 0.25, 0.33, 0.5, 0.75),
) -> dict:
    """How many of the slot cache's misses a page cache would serve: what reading uncached
    (``expert_io=direct``) gives up. The default policy (``transition``) holds ``budget`` of each
    layer's experts; every miss is read from the files, through one LRU page cache shared by all
    layers that holds ``fraction`` of all the experts (an expert read stays in it until pushed
    out, resident in the slots or not).

    Args:
        trace: the recording.
        budget: the slots, a fraction of each layer's experts.
        fractions: page cache sizes, fractions of all the experts.

    Returns:
        ``{"budget", "misses_per_token", "rows": [{"fraction", "served"}]}``: ``served`` is
        the share of the slot misses the page cache would have held.
    """
    tokens = trace.routed.shape[0]
    misses: List[Tuple[int, int]] = []  # (layer, expert), in order of reading
    per_layer = []
    default = POLICIES["transition"]
    for j, e in enumerate(trace.num_experts):
        slots = budget_slots(budget, e, trace.top_k)
        per_layer.append([m for _, m, _ in replay(trace.routed[:, j], e, slots, default(e, slots))])
    for t in range(tokens):
        for j, rows in enumerate(per_layer):
            misses += [(j, int(x)) for x in rows[t]]
    total = sum(trace.num_experts)
    out = []
    for frac in fractions:
        cap, held, served = max(int(frac * total), 1), {}, 0  # dict order: least recent first
        for key in misses:
            if key in held:
                served += 1
                del held[key]
            elif len(held) >= cap:
                del held[next(iter(held))]
            held[key] = True
        out.append({"fraction": float(frac), "served": served / max(len(misses), 1)})
    return {"budget": budget, "misses_per_token": len(misses) / max(tokens, 1), "rows": out}


def one_hot(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Sets of experts as masks.

    Args:
        experts: ``[tokens, k]`` expert indices (-1: none).
        num_experts: the layer's experts.

    Returns:
        ``[tokens, num_experts]`` bool.
    """
    out = np.zeros((experts.shape[0], num_experts + 1), bool)
    np.put_along_axis(out, np.where(experts < 0, num_experts, experts), True, axis=1)
    return out[:, :num_experts]


def window_scores(routed: np.ndarray, num_experts: int, n: int) -> np.ndarray:
    """Rank the experts of the last ``n`` tokens, for every token: by how often they were used
    in that window, ties by how recently.

    Args:
        routed: ``[tokens, k]`` one layer's routed experts.
        num_experts: the layer's experts.
        n: the window (1: the previous token).

    Returns:
        ``[tokens, num_experts]`` scores; -inf for the experts the window did not use (the
        first token's window is empty).
    """
    hot = one_hot(routed, num_experts).astype(np.int64)
    tokens = hot.shape[0]
    csum = np.concatenate([np.zeros((1, num_experts), np.int64), np.cumsum(hot, axis=0)])
    t = np.arange(tokens)
    count = csum[t] - csum[np.maximum(t - n, 0)]  # uses in tokens [t - n, t)
    # the last token before t that used each expert (-1: none)
    seen = np.where(hot.astype(bool), t[:, None], -1)
    last = np.maximum.accumulate(seen, axis=0)
    last_before = np.vstack([np.full((1, num_experts), -1), last[:-1]])
    score = count + (last_before + 1) / (tokens + 1.0)  # the recency term is < 1
    return np.where(count > 0, score, -np.inf)


def reuse_table(trace: RoutingTrace, windows: Sequence[int]) -> List[dict]:
    """Reuse: the share of each token's routed experts that the same layer used in the last N
    tokens, and how many distinct experts those N tokens used (mean per layer), over every MoE
    layer and the tokens from ``max(windows)`` on (whole windows only).

    Args:
        trace: the recording.
        windows: the window sizes.

    Returns:
        ``[{"window", "reuse", "distinct", "distinct_share"}]``.
    """
    start = min(max(windows), max(trace.routed.shape[0] - 1, 0))
    out = []
    for n in windows:
        hit = total = distinct = 0
        share = 0.0
        for i, e in zip(trace.layers, trace.num_experts):
            r = trace.layer(i)
            hot = one_hot(r, e)[start:]
            named = np.isfinite(window_scores(r, e, n))[start:]
            hit += int((named & hot).sum())
            total += int(hot.sum())
            distinct += int(named.sum())
            share += named.sum() / max(named.shape[0] * e, 1)
        rows = (trace.routed.shape[0] - start) * len(trace.layers)
        out.append(
            {
                "window": n,
                "reuse": hit / max(total, 1),
                "distinct": distinct / max(rows, 1),
                "distinct_share": share / max(len(trace.layers), 1),
            }
        )
    return out


# ---------------------------------------------------------------------------------- skew


def skew(counts: np.ndarray) -> dict:
    """How unevenly one layer's experts are used.

    Args:
        counts: ``[experts]`` routings per expert.

    Returns:
        ``top10``: share of the routings taken by the most used 10% of the experts (at least
        one); ``entropy``: the entropy of the usage distribution over log(experts) (1: uniform);
        ``gini``: the Gini coefficient of the counts (0: uniform, towards 1: one expert);
        ``unused``: experts never routed to.
    """
    c = np.sort(np.asarray(counts, np.float64))[::-1]
    n, total = c.size, c.sum()
    if not total:
        return {"top10": 0.0, "entropy": 0.0, "gini": 0.0, "unused": n}
    p = c / total
    nz = p[p > 0]
    top = max(1, int(np.ceil(0.1 * n)))
    ascending = c[::-1]
    gini = float((2 * np.arange(1, n + 1) - n - 1) @ ascending / (n * total))
    return {
        "top10": float(c[:top].sum() / total),
        "entropy": float(-(nz * np.log(nz)).sum() / np.log(n)) if n > 1 else 1.0,
        "gini": gini,
        "unused": int((c == 0).sum()),
    }


def skew_table(trace: RoutingTrace) -> dict:
    """``skew`` per MoE layer, and its mean, min and max over the layers.

    Args:
        trace: the recording.

    Returns:
        ``{"per_layer": {layer: skew}, "mean": ..., "min": ..., "max": ...}``.
    """
    per = {
        i: skew(np.bincount(trace.layer(i).ravel(), minlength=e))
        for i, e in zip(trace.layers, trace.num_experts)
    }
    keys = ("top10", "entropy", "gini", "unused")
    vals = {k: np.array([s[k] for s in per.values()], np.float64) for k in keys}
    return {
        "per_layer": per,
        "mean": {k: float(v.mean()) for k, v in vals.items()},
        "min": {k: float(v.min()) for k, v in vals.items()},
        "max": {k: float(v.max()) for k, v in vals.items()},
    }


# ------------------------------------------------------------------------------- the report


def analyze(
    trace: RoutingTrace,
    budgets: Sequence[float] = (0.1, 0.25, 0.5),
    windows: Sequence[int] = (1, 2, 4, 8, 12, 16),
) -> dict:
    """Everything the benchmark reports about one trace.

    Args:
        trace: the recording.
        budgets: replay budgets (fractions of each layer's experts).
        windows: window sizes for reuse.

    Returns:
        ``{"meta", "shape", "skew", "reuse", "replay", "page_cache"}``.
    """
    return {
        "meta": trace.meta,
        "shape": {
            "tokens": int(trace.routed.shape[0]),
            "layers": trace.layers,
            "num_experts": trace.num_experts,
            "top_k": trace.top_k,
        },
        "skew": skew_table(trace),
        "reuse": reuse_table(trace, windows),
        "replay": replay_table(trace, budgets),
        "page_cache": page_cache_table(trace),
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_report(result: dict) -> str:
    """Markdown tables of ``analyze``'s result.

    Args:
        result: ``analyze``'s dict (or the same read back from JSON).

    Returns:
        The tables, with a line of context above each.
    """
    shape, meta = result["shape"], result["meta"]
    k = shape["top_k"]
    experts = sorted(set(shape["num_experts"]))
    lines = [
        f"{meta.get('mode', '?')} trace of {meta.get('model', '?')}: {shape['tokens']} tokens, "
        f"{len(shape['layers'])} MoE layers, {'/'.join(map(str, experts))} experts, top-{k}"
        + (
            f"; prompt: the first {meta['prompt_tokens']} tokens of {meta.get('source', '?')}"
            if "prompt_tokens" in meta
            else f"; text: {meta['source']}"
            if meta.get("source")
            else ""
        )
        + ".",
        "",
        "### Expert popularity (per layer: mean, min-max)",
        "",
        "| top 10% of experts' share | normalized entropy | Gini | experts never used |",
        "|---|---|---|---|",
    ]
    s = result["skew"]
    lines.append(
        " | ".join(
            [
                f"| {_pct(s['mean']['top10'])} ({_pct(s['min']['top10'])}-{_pct(s['max']['top10'])})",
                f"{s['mean']['entropy']:.3f} ({s['min']['entropy']:.3f}-{s['max']['entropy']:.3f})",
                f"{s['mean']['gini']:.3f} ({s['min']['gini']:.3f}-{s['max']['gini']:.3f})",
                f"{s['mean']['unused']:.1f} ({s['min']['unused']:.0f}-{s['max']['unused']:.0f}) |",
            ]
        )
    )
    lines += [
        "",
        "### Reuse: routed experts the same layer used in the last N tokens",
        "",
        "| N | reuse | distinct experts in the window | share of the layer |",
        "|---|---|---|---|",
    ]
    for r in result["reuse"]:
        lines.append(
            f"| {r['window']} | {_pct(r['reuse'])} | {r['distinct']:.1f} | "
            f"{_pct(r['distinct_share'])} |"
        )
    rep = result["replay"]
    cols = rep["columns"]
    lines += [
        "",
        f"### Eviction: misses per token (every MoE layer's summed), {rep['tokens']} tokens from "
        "a cold cache; in brackets the ratio to LRU",
        "",
        "| budget | slots | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for r in rep["rows"]:
        lru = r["lru"] or 1.0
        slots = "/".join(map(str, sorted(set(r["slots"]))))
        lines.append(
            f"| {r['budget']:.0%} | {slots} | "
            + " | ".join(f"{r[c]:.2f} ({r[c] / lru:.2f})" for c in cols)
            + " |"
        )
    pc = result.get("page_cache")  # absent from reports saved before 2026-11-27
    if pc:
        lines += [
            "",
            f"### What a page cache would serve (transition's slots at {pc['budget']:.0%}, "
            f"{pc['misses_per_token']:.2f} misses per token)",
            "",
            "Reading uncached (`expert_io=direct`) gives these up: an LRU page cache shared by "
            "every layer, holding a share of all the experts.",
            "",
            "| page cache, share of the experts | slot misses it serves |",
            "|---|---|",
        ]
        for r in pc["rows"]:
            lines.append(f"| {r['fraction']:.0%} | {_pct(r['served'])} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ recording


@contextlib.contextmanager
def _patched_calls(sink: Callable) -> Iterator[None]:
    """Within it, every ``StreamingSwitchGLU`` call also goes to ``sink(layer, x, indices)``."""
    original = StreamingSwitchGLU.__call__

    def call(self, x, indices):
        sink(self.layer, x, indices)
        return original(self, x, indices)

    StreamingSwitchGLU.__call__ = call
    try:
        yield
    finally:
        StreamingSwitchGLU.__call__ = original


class _Recorder:
    """Collects one forward pass's routing and turns it into the trace's rows."""

    def __init__(self, model):
        layout = model.moeflux.layout
        self.layers = sorted(layout.module_paths)
        self.num_experts = [layout.layers[i].num_experts for i in self.layers]
        self.calls: Dict[int, np.ndarray] = {}
        self.routed: List[np.ndarray] = []

    def sink(self, layer: int, x, indices) -> None:
        self.calls[layer] = np.array(indices).reshape(-1, indices.shape[-1])

    def finish_pass(self) -> None:
        """Turn the calls of the pass just run into rows of the routing."""
        if set(self.calls) != set(self.layers):
            raise ValueError(f"a forward pass called layers {sorted(self.calls)}, not all of them")
        self.routed.append(np.stack([self.calls[i] for i in self.layers], axis=1))
        self.calls.clear()

    def trace(self, tokens: np.ndarray, meta: dict) -> RoutingTrace:
        return RoutingTrace(
            routed=np.concatenate(self.routed),
            layers=self.layers,
            num_experts=self.num_experts,
            tokens=np.asarray(tokens, np.int64),
            meta=meta,
        )


def _vocab_size(model) -> Optional[int]:
    args = getattr(model, "args", None)
    vocab = getattr(args, "vocab_size", None)
    text = getattr(args, "text_config", None)
    if vocab is None and isinstance(text, dict):
        vocab = text.get("vocab_size")
    return vocab


def record_text(
    model_path: Union[str, Path],
    tokens: np.ndarray,
    context: int = 512,
    decode: int = 0,
    prompt_tokens: int = 64,
    meta: Optional[dict] = None,
) -> Tuple[RoutingTrace, Optional[RoutingTrace]]:
    """Record the routing of a text, teacher-forced: one forward pass per ``context`` tokens
    (each window on its own, no cache), every expert resident (``cache_budget="all"``, ops).
    With ``decode``, also a greedy decode of that many tokens from the text's first
    ``prompt_tokens``.

    Args:
        model_path: any checkpoint ``moeflux_mlx.load`` opens (plain or converted).
        tokens: the text's token ids.
        context: tokens per forward pass.
        decode: greedy decode tokens (0: none).
        prompt_tokens: the decode's prompt, from the start of the text.
        meta: added to each trace's ``meta``.

    Returns:
        ``(text_trace, decode_trace or None)``.

    Raises:
        ValueError: the text has a token id the model's vocabulary lacks, or no tokens.
    """
    tokens = np.asarray(tokens, np.int64)
    if not tokens.size:
        raise ValueError("no tokens to record")
    model, _ = load(model_path, cache_budget="all", backend="ops")
    vocab = _vocab_size(model)
    if vocab is not None and int(tokens.max()) >= vocab:
        raise ValueError(
            f"token id {int(tokens.max())} is outside the model's vocabulary ({vocab})"
        )
    base = {"model": str(model_path), "context": context, **(meta or {})}
    with model.moeflux:
        rec = _Recorder(model)
        with _patched_calls(rec.sink):
            for start in range(0, tokens.size, context):
                mx.eval(model(mx.array(tokens[start : start + context])[None]))
                rec.finish_pass()
        text = rec.trace(tokens, {**base, "mode": "teacher-forced"})
        if not decode:
            return text, None
        drec = _Recorder(model)
        out: List[int] = []
        with _patched_calls(drec.sink):
            # generate_step runs one token ahead: when it yields token y, the last pass run
            # took y as its input (the prompt's passes before it were overwritten)
            prompt = mx.array(tokens[:prompt_tokens])
            for y, _ in generate_step(prompt, model, max_tokens=decode):
                drec.finish_pass()
                out.append(int(y))
        dec = drec.trace(
            np.array(out, np.int64),
            {**base, "mode": "greedy decode", "prompt_tokens": prompt_tokens},
        )
    return text, dec
