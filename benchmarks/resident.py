"""Where a decode step's time goes with every expert resident: stock mlx-lm, moeflux-mlx, and
moeflux-mlx with the experts' computation skipped (the ceiling), side by side.

Each round decodes the same prompt with each model in turn, twice:

- through mlx-lm's own loop (``generate_step``, which builds the next step while the device
  computes this one): decode tok/s, its ratio to stock's in the same round, and the share of
  the ceiling's rate reached;
- one step at a time, with nothing overlapped, each step timed in three parts: **build** (Python
  building the step's graph: the model call and the argmax), **launch** (``mx.async_eval``:
  MLX encoding every node and handing it to the device, on the host) and **wait** (until the
  token is ready: what the device still had to do).

The ceiling is the moeflux model itself with its expert backend swapped for one that reads no
weight and launches no kernel (``benchmarks.lib.decode.SkippedExperts``), so every other cost
of the drop-in (routing, the cache's resident path, the counters) stays in it. The gap between
moeflux and the ceiling, split into build, launch and wait and divided by the MoE layers, is
what the expert computation costs a layer; ``compute ms/tok`` is the backend's own Python
time inside build (the counters' ``compute_s``). A second table times the expert computation's
calls alone against the least any launch costs (``launch_costs``).

    python benchmarks/resident.py MODEL [--rounds 3] [--decode-tokens 64] [--out DIR]
    python benchmarks/resident.py --arch qwen3_moe --size full --layers 48

Prints a table of medians (ranges over rounds) and writes ``DATE-MACHINE-resident.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from benchmarks.lib import cli  # noqa: E402
from benchmarks.lib.decode import SkippedExperts  # noqa: E402
from moeflux_mlx import measure  # noqa: E402
from moeflux_mlx.commands.common import main_for  # noqa: E402
from moeflux_mlx.commands.doctor import top_k_of  # noqa: E402
from moeflux_mlx.format.checkpoint import expert_layout  # noqa: E402
from moeflux_mlx.model.load import load  # noqa: E402

STOCK, MOEFLUX, CEILING = "stock mlx-lm", "moeflux resident", "experts skipped (ceiling)"
PARTS = ("build", "launch", "wait")


def split_steps(model, prompt: mx.array, tokens: int) -> Dict[str, float]:
    """ms per token of each part of ``tokens`` greedy steps, one at a time (module text)."""
    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt[None], cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    spent = dict.fromkeys(PARTS, 0.0)
    for _ in range(tokens):
        t0 = time.perf_counter()
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2)):
            spent[part] += dt
    return {part: 1e3 * s / tokens for part, s in spent.items()}


_EMPTY = "if (threadIdx.x > 1024) { out[0] = x[0]; }"  # launches, computes nothing


def _empty_kernel(x: mx.array, header_kb: int):
    header = ("// " + "x" * 61 + "\n") * (16 * header_kb)
    kernel = mx.fast.cuda_kernel(
        name=f"resident_probe_empty_{header_kb}",
        input_names=["x"],
        output_names=["out"],
        source=_EMPTY,
        header=header,
    )
    launch = dict(
        grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[x.dtype]
    )
    return lambda: kernel(inputs=[x], **launch)[0]


def launch_costs(model, backend, top_k: int, calls: int = 480) -> Dict[str, Dict[str, float]]:
    """Host µs per call of the expert computation alone, on the first MoE layer's resident
    pool at one decode token: ``calls`` calls built (Python) and then launched together
    (``mx.async_eval``), then waited for; beside it a plain MLX op and, on CUDA, a custom kernel
    with a one-line body (the least a launch of its own costs) under headers of comments of
    0, 9 and 15 KB (MLX rebuilds and hashes a kernel's whole text at every launch; the fused
    kernels' texts are 9 KB as handed over, 15 KB with their comments)."""
    from moeflux_mlx.model.switch import StreamingSwitchGLU

    rt = model.moeflux
    layer, activation = next(
        (m.layer, m.activation)
        for _, m in model.named_modules()
        if isinstance(m, StreamingSwitchGLU)
    )
    pool = rt.cache.slots.resident[layer]
    q = pool.quantization  # the input width: from the scales where quantized
    w = pool.arrays["gate_proj.weight"]
    hidden = pool.arrays["gate_proj.scales"].shape[-1] * q.group_size if q else w.shape[-1]
    x = mx.random.normal((1, 1, hidden)).astype(mx.bfloat16)
    slots = mx.array([[list(range(top_k))]], dtype=mx.uint32)
    ways = {
        "expert computation (moeflux's backend)": lambda: backend(x, slots, pool, activation),
        "plain MLX op (x + 1)": lambda: x + 1,
    }
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        for kb in (0, 9, 15):  # a header of comments: what MLX rebuilds and hashes per launch
            ways[f"custom kernel, one-line body, {kb} KB header"] = _empty_kernel(x, kb)
    out = {}
    for name, call in ways.items():
        best = None
        for _ in range(3):
            mx.eval(call())
            t0 = time.perf_counter()
            ys = [call() for _ in range(calls)]
            t1 = time.perf_counter()
            mx.async_eval(ys)
            t2 = time.perf_counter()
            mx.eval(ys)
            t3 = time.perf_counter()
            run = {
                "build": 1e6 * (t1 - t0) / calls,
                "launch": 1e6 * (t2 - t1) / calls,
                "wait": 1e6 * (t3 - t2) / calls,
            }
            if best is None or run["build"] + run["launch"] < best["build"] + best["launch"]:
                best = run
            del ys
        out[name] = best
    return out


def format_launch_costs(costs: Dict[str, Dict[str, float]]) -> str:
    lines = [
        "| one call of | build µs | launch µs | host µs | wait µs |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, c in costs.items():
        lines.append(
            f"| {name} | {c['build']:.1f} | {c['launch']:.1f} | "
            f"{c['build'] + c['launch']:.1f} | {c['wait']:.1f} |"
        )
    return "\n".join(lines)


def _compute_ms(model) -> float:
    return 1e3 * sum(s.compute_s for s in model.moeflux.stats.layers.values())


def measure_rounds(path: Path, rounds: int, tokens: int, shares: Sequence[float] = ()) -> dict:
    """Load stock and moeflux (every expert resident, and at each of ``shares`` of the experts'
    bytes: the streaming path), decode in turn ``rounds`` times."""
    stock = mlx_lm.load(str(path))[0]
    model, _ = load(path, cache_budget="all")
    backend = model.moeflux.backend
    layout = expert_layout(path)
    total, layers = layout.total_expert_bytes, len(layout.layers)
    partial = {f"moeflux at {f:.0%}": load(path, cache_budget=int(f * total))[0] for f in shares}
    prompt = mx.array(list(range(100, 164)))
    runs: Dict[str, List[dict]] = {STOCK: [], MOEFLUX: [], CEILING: [], **{n: [] for n in partial}}

    def use(name: str):
        if name == STOCK:
            return stock
        if name in partial:
            return partial[name]
        model.moeflux.backend = SkippedExperts() if name == CEILING else backend
        return model

    try:
        for name in runs:  # kernels compiled, allocator warm
            measure.time_generation(use(name), prompt, measure.WARM_UP_TOKENS)
        for r in range(rounds):
            order = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]
            for name in order:
                m = use(name)
                tps = measure.time_generation(m, prompt, tokens)[1]
                before = _compute_ms(m) if m is not stock else 0.0
                parts = split_steps(m, prompt, tokens)
                if m is not stock:  # the backend's Python time, per token (prefill's is small)
                    parts["compute"] = (_compute_ms(m) - before) / (tokens + 1)
                runs[name].append(dict(parts, tps=tps))
        costs = launch_costs(model, backend, top_k_of(path))  # its own backend, not the ceiling's
    finally:
        model.moeflux.backend = backend
        for m in (model, *partial.values()):
            m.moeflux.close()
    return {
        "layers": layers,
        "tokens": tokens,
        "rounds": rounds,
        "runs": runs,
        "launch_costs": costs,
    }


def summarize(result: dict) -> List[dict]:
    """One row per model: medians (and ranges) of tok/s, ratios and the split."""
    runs, layers = result["runs"], result["layers"]
    stock = [r["tps"] for r in runs[STOCK]]
    ceiling = [r["tps"] for r in runs[CEILING]]
    rows = []
    for name, rs in runs.items():
        row = {"model": name, "tps": [r["tps"] for r in rs]}
        row["x_stock"] = [r["tps"] / s for r, s in zip(rs, stock)]
        row["of_ceiling"] = [r["tps"] / c for r, c in zip(rs, ceiling)]
        for part in (*PARTS, "compute"):
            if part in rs[0]:
                row[part] = [r[part] for r in rs]
        if name != STOCK:  # µs a MoE layer beyond the ceiling's, part by part
            for part in PARTS:
                row[f"{part}_us_layer"] = [
                    1e3 * (r[part] - c[part]) / layers for r, c in zip(rs, runs[CEILING])
                ]
        rows.append(row)
    return rows


def _cell(values, fmt: str) -> str:
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    return (
        med if len(values) < 2 else f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"
    )


TABLE = (
    ("tps", "decode tok/s", "{:.1f}"),
    ("x_stock", "x stock", "{:.3f}"),
    ("of_ceiling", "of ceiling", "{:.3f}"),
    ("build", "build ms/tok", "{:.2f}"),
    ("launch", "launch ms/tok", "{:.2f}"),
    ("wait", "wait ms/tok", "{:.2f}"),
    ("compute", "compute ms/tok", "{:.2f}"),
    ("build_us_layer", "build µs/layer over ceiling", "{:.1f}"),
    ("launch_us_layer", "launch µs/layer over ceiling", "{:.1f}"),
    ("wait_us_layer", "wait µs/layer over ceiling", "{:.1f}"),
)


def format_table(rows: List[dict]) -> str:
    lines = ["| model | " + " | ".join(h for _, h, _ in TABLE) + " |"]
    lines.append("|" + " --- |" * (len(TABLE) + 1))
    for row in rows:
        cells = [_cell(row.get(k), fmt) for k, _, fmt in TABLE]
        lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_model_args(parser, size="full")
    parser.add_argument("--rounds", type=cli.positive_int, default=3)
    parser.add_argument("--decode-tokens", type=cli.positive_int, default=64)
    parser.add_argument(
        "--budgets",
        type=cli.budget_list,
        default=[],
        help="also moeflux at these shares of the experts' bytes (e.g. 0.99: the streaming "
        "path, nearly every expert resident, split the same way)",
    )
    parser.add_argument("--machine", help="machine name for the results (default: detected)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--no-write", action="store_true", help="print only")

    def run(args) -> int:
        args.convert = False
        path, _ = cli.benchmark_model(args)
        result = measure_rounds(path, args.rounds, args.decode_tokens, args.budgets)
        rows = summarize(result)
        machine = args.machine or measure.machine_name()
        table = format_table(rows) + "\n\n" + format_launch_costs(result["launch_costs"])
        print(f"\n{path.name}, {result['layers']} MoE layers, {machine}\n\n{table}")
        if not args.no_write:
            args.out.mkdir(parents=True, exist_ok=True)
            stem = measure.free_stem(
                args.out, f"{datetime.date.today()}-{measure.machine_tag(machine)}-resident"
            )
            (args.out / f"{stem}.json").write_text(
                json.dumps(dict(result, machine=machine, model=str(path)), indent=1)
            )
            (args.out / f"{stem}.md").write_text(
                f"# Resident decode: where a step's time goes ({machine})\n\n"
                f"Model: `{path}`, {result['layers']} MoE layers; {args.decode_tokens} tokens, "
                f"{args.rounds} rounds, medians (ranges).\n\n"
                f"Command: `python benchmarks/resident.py {' '.join(argv or sys.argv[1:])}`\n\n"
                f"{table}\n"
            )
            print(f"\nWrote {args.out / stem}.{{md,json}}")
        return 0

    return main_for(parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
