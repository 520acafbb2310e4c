"""The host (Python) time of building one decode step with every expert resident: moeflux-mlx
against stock mlx-lm, on any machine, the CPU included.

On a GPU, decode is host-bound: every token builds the whole model graph from Python, layer by
layer, and every microsecond a MoE layer adds is a microsecond per token per layer. This times
the building alone (the model call and the argmax; nothing is evaluated inside the timing) of
one decode step of a random-weight model (``tests.support.synth``), for:

- **stock**: ``mlx_lm.load`` as it is (its ``SwitchGLU`` builds its ``gather_qmm`` nodes);
- **moeflux**: ``moeflux_mlx.load(cache_budget="all")`` with its backend (plain ops on the CPU:
  the same ``gather_qmm`` nodes as stock's);
- **moeflux, experts skipped**: the same with the backend swapped for
  ``benchmarks.lib.decode.SkippedExperts`` (one broadcast node), so that what remains of a MoE
  layer is the drop-in's own Python: the cache's resident path, the counters, the casts.

and, one MoE layer's expert call alone on one token's router output (the step's other layers
left out): stock's ``SwitchGLU``, and moeflux's streaming module with each backend.

Each step is built, timed, then evaluated outside the timing (the KV cache stays small and the
graph does not grow); the KV caches start again every ``--steps`` steps. Rounds alternate the
models; the figures are medians over every step (or every 64 calls) of every round, in µs per
MoE layer: a step's build time divided by the layers.

``--base DIR``: another source tree holding ``moeflux_mlx`` (``git archive REV moeflux_mlx |
tar -x -C DIR``), imported into the same process as ``moeflux_base`` (the package imports
itself relatively), its moeflux rows measured in turn with this checkout's: a change's before
and after under the same machine noise, which on a small VM moves figures by half between
processes. (A GPU's kernel texts are read where the installed package finds them.)

    python benchmarks/host_path.py [--layers 48] [--rounds 5] [--steps 64] [--base DIR]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.models.switch_layers import SwitchGLU  # noqa: E402

from benchmarks.lib.decode import SkippedExperts  # noqa: E402
from moeflux_mlx.format.checkpoint import expert_layout  # noqa: E402
from moeflux_mlx.model.load import load  # noqa: E402
from moeflux_mlx.model.switch import StreamingSwitchGLU  # noqa: E402
from tests.support import synth  # noqa: E402

STOCK, OURS, SKIPPED = "stock mlx-lm", "moeflux", "moeflux, experts skipped"
CALL = 64  # layer calls timed together (one figure), their outputs then let go


def step_builds(model, steps: int) -> List[float]:
    """Seconds to build each of ``steps`` decode steps (each evaluated after its timing)."""
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([[1, 2, 3, 4]]), cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        out.append(time.perf_counter() - t0)
        mx.eval(y)
    return out


def layer_calls(model, kind: type, calls: int) -> List[float]:
    """Seconds per call of the model's first module of ``kind`` (its experts' call) on one
    decode token's router output: ``calls`` calls built, timed ``CALL`` at a time."""
    module: nn.Module = next(m for _, m in model.named_modules() if isinstance(m, kind))
    args = model.args
    x = mx.random.normal((1, 1, args.hidden_size)).astype(mx.bfloat16)
    indices = mx.array([[list(range(args.num_experts_per_tok))]], dtype=mx.uint32)
    mx.eval(x, indices, module(x, indices))
    out = []
    for _ in range(max(1, calls // CALL)):
        t0 = time.perf_counter()
        kept = [module(x, indices) for _ in range(CALL)]
        out.append((time.perf_counter() - t0) / CALL)
        del kept
    return out


def import_base(tree: Path) -> Tuple[Callable, type]:
    """``load`` and ``StreamingSwitchGLU`` of the ``moeflux_mlx`` in ``tree``, imported beside
    this checkout's as the package ``moeflux_base``."""
    root = tree / "moeflux_mlx"
    spec = importlib.util.spec_from_file_location(
        "moeflux_base", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"--base {tree}: no moeflux_mlx package there")
    sys.modules["moeflux_base"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    load_base = importlib.import_module("moeflux_base.model.load").load
    return load_base, importlib.import_module("moeflux_base.model.switch").StreamingSwitchGLU


def measure(path: Path, rounds: int, steps: int, base: Optional[Path] = None):
    """µs per MoE layer of each way (module text), ``rounds`` rounds of ``steps`` steps."""
    stock = mlx_lm.load(str(path))[0]
    layers = len(expert_layout(path).layers)
    calls = steps * layers
    ways: Dict[str, Callable[[], List[float]]] = {
        f"step: {STOCK}": lambda: [t / layers for t in step_builds(stock, steps)],
        f"layer call: {STOCK} SwitchGLU": lambda: layer_calls(stock, SwitchGLU, calls),
    }
    builds = [("", load, StreamingSwitchGLU)]
    if base is not None:
        builds.append(("base ", *import_base(base)))
    models = []
    for tag, load_build, kind in builds:
        ours, _ = load_build(path, cache_budget="all")
        skipped, _ = load_build(path, cache_budget="all")
        skipped.moeflux.backend = SkippedExperts()
        models += [ours, skipped]
        name = f"{tag}{OURS} ({ours.moeflux.backend.name})"
        for label, m in ((name, ours), (f"{tag}{SKIPPED}", skipped)):
            ways[f"step: {label}"] = lambda m=m: [t / layers for t in step_builds(m, steps)]
            ways[f"layer call: {label}"] = lambda m=m, k=kind: layer_calls(m, k, calls)
    ways = dict(sorted(ways.items(), key=lambda kv: not kv[0].startswith("step")))
    times: Dict[str, List[float]] = {k: [] for k in ways}
    try:
        for way in ways.values():  # warm up: allocator, first-call plans, resident pools
            way()
        for r in range(rounds):
            order = list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]
            for name in order:
                times[name].extend(ways[name]())
    finally:
        for m in models:
            m.moeflux.close()
    return times


def format_table(times: Dict[str, List[float]]) -> str:
    lines = ["| build of | µs per MoE layer | p25-p75 | min |", "| --- | --- | --- | --- |"]
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else None
        spread = f"{1e6 * q[0]:.2f}-{1e6 * q[2]:.2f}" if q else "-"
        lines.append(
            f"| {name} | {1e6 * statistics.median(ts):.2f} | {spread} | {1e6 * min(ts):.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=48, help="decoder layers (default 48)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per round and way")
    parser.add_argument("--model", type=Path, help="an existing checkpoint (default: built)")
    parser.add_argument("--base", type=Path, help="another source tree to measure in turn")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or synth.build_checkpoint(
            Path(tmp) / "model",
            "qwen3_moe",
            "tiny",
            overrides={"num_hidden_layers": args.layers},
        )
        times = measure(path, args.rounds, args.steps, args.base)
    print(f"{mx.default_device()}, {args.rounds} rounds x {args.steps} steps, medians\n")
    print(format_table(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
