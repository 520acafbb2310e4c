"""``moeflux-mlx info``: what would stream from a model and how: MoE layers, experts, sizes, the
RAM gate's choice, the cache budget, the backend, which backend each MoE layer's decode calls
would run on and why (``compute.backend.layer_choice``, the runtime's own decision), and what
the machine decided rather than an option (``model.runtime.machine_choices``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import psutil

from ..cache.curve import resolve_budget
from ..cache.slots import too_small
from ..compute.backend import LayerChoice, backend_report, layer_choice, select_backend
from ..compute.kernels import ExpertSpec
from ..format.checkpoint import is_packed, packed_layout, read_config, scan_checkpoint
from ..format.layout import ModelLayout
from ..format.safetensors import index_directory
from ..io.store import choose_expert_io, open_store
from ..model.experts import build_model, find_experts, top_k_of
from ..model.runtime import machine_choices
from ..options import LoadOptions, budget_unit
from .common import (
    MACHINE_HEADING,
    MACHINE_NOTE,
    add_load_args,
    command_parser,
    device_name,
    fmt_budget,
    fmt_bytes,
    load_kwargs,
    main_for,
    resolve_model,
)

DESCRIPTION = (
    "describe a model: MoE layers, experts, sizes, how experts would be read (RAM "
    "gate) and which kernels"
)


@dataclass(frozen=True)
class LayerGroup:
    """Consecutive MoE layers whose decode calls run on the same backend for the same reason."""

    layers: Tuple[int, ...]
    backend: str  # "metal", "cuda" or "ops"
    reason: str
    on_gpu: Optional[str]  # where ops run for the machine or the option: what a GPU would run

    @property
    def label(self) -> str:
        first, last = self.layers[0], self.layers[-1]
        if len(self.layers) == 1:
            return f"layer {first}"
        # dense layers between them (deepseek's first, llama4's every other) are no MoE layers
        gaps = "" if last - first + 1 == len(self.layers) else f" ({len(self.layers)} MoE layers)"
        return f"layers {first}-{last}{gaps}"

    def __str__(self) -> str:
        return f"{self.label}: {LayerChoice(self.backend, self.reason, self.on_gpu)}"


def group_layers(choices: Dict[int, LayerChoice]) -> List[LayerGroup]:
    """Runs of consecutive MoE layers (in layer order) with the same choice.

    Args:
        choices: MoE layer -> its ``LayerChoice``.

    Returns:
        The runs, in layer order.
    """
    groups: List[Tuple[List[int], LayerChoice]] = []
    for layer in sorted(choices):
        choice = choices[layer]
        if groups and groups[-1][1] == choice:
            groups[-1][0].append(layer)
        else:
            groups.append(([layer], choice))
    return [LayerGroup(tuple(ids), c.backend, c.reason, c.on_gpu) for ids, c in groups]


def _activation_dtype(text: dict):
    """The model's activation dtype from its config, or None (then any float dtype)."""
    name = text.get("torch_dtype") or text.get("dtype")
    dtype = getattr(mx, str(name), None) if name else None
    return dtype if isinstance(dtype, mx.Dtype) else None


def layer_backends(
    config: dict, layout: ModelLayout, backend, where: object = "config.json"
) -> List[LayerGroup]:
    """Which backend each MoE layer's decode calls would run on, grouped.

    Args:
        config: the model's ``config.json``.
        layout: its expert layout.
        backend: what ``select_backend`` picked for the options given.
        where: for messages.

    Returns:
        ``group_layers`` of every MoE layer's ``layer_choice``.

    Raises:
        CheckpointError: mlx-lm cannot build the model (the activations come from its modules).
    """
    text = config.get("text_config", config)
    experts = find_experts(build_model(config, where))  # lazy: no weight is materialized
    topk = text.get("num_experts_per_tok")
    dtype = _activation_dtype(text) or _activation_dtype(config)
    choices = {}
    for layer, lay in layout.layers.items():
        module = experts.get(layout.module_paths[layer])
        activation = getattr(module.module, "activation", None) if module else None
        choices[layer] = layer_choice(
            backend,
            ExpertSpec.of_layout(lay),
            activation,
            dtype=dtype,
            topk=int(topk) if topk else None,
        )
    return group_layers(choices)


def describe(path: Path, given: Optional[dict] = None) -> list:
    """``(label, value)`` rows saying what would stream from ``path`` and how.

    Args:
        path: a converted directory or an mlx-lm checkpoint.
        given: the load options given on the command line (``common.load_kwargs``).

    Returns:
        ``[(label, value), ...]``; the value of ``backend by layer`` is a list of
        ``LayerGroup`` (or one string saying why it is unknown), that of ``decided by the
        machine`` a list of ``(what, the choice and why)`` pairs, every other value a string.

    Raises:
        CheckpointError: not a usable MoE checkpoint.
    """
    given = given or {}
    options = LoadOptions.resolve(**given)
    path = Path(path)
    config = read_config(path)
    text = config.get("text_config", config)
    packed = is_packed(path)
    # every check that load() makes from headers and file sizes (a truncated layer file, a
    # layout that does not match its files ...), so that info reports the damage generate would
    open_store(path, options.expert_io, 1)[0].close()
    if packed:
        layout = packed_layout(path)
        dense = sum(r.nbytes for r in index_directory(path).values())
    else:
        ckpt = scan_checkpoint(path)
        layout, dense = ckpt.layout, sum(r.nbytes for r in ckpt.dense.values())
    layers = sorted(layout.layers)
    lay = [layout.layers[i] for i in layers]

    def one_or_all(values):
        values = sorted(set(values))
        return str(values[0]) if len(values) == 1 else ", ".join(map(str, values))

    def quant(q):
        return "none (unquantized)" if q is None else f"{q.bits}-bit {q.mode}, group {q.group_size}"

    total = layout.total_expert_bytes
    ram = psutil.virtual_memory()
    mode, why = choose_expert_io(total, options.expert_io)
    source = options.source("expert_io", given)
    if source.startswith("--"):
        why = f"requested: {source} {options.expert_io}"
    elif source != "default":
        why = f"requested: {source}"
    # valid: LoadOptions.resolve checked it; auto as a load would choose it (the curve file)
    chosen = resolve_budget(options.cache_budget, layout, path, options.eviction)
    budget = chosen.bytes
    unit = budget_unit(options.cache_budget)  # sizes in the units the budget was given in
    if options.cache_budget is None:
        given_as = "default"
    elif chosen.auto:
        given_as = f"--cache-budget {chosen.why}"
    else:
        given_as = f"--cache-budget {fmt_budget(options.cache_budget, total)}"
    # a budget over the experts holds them all: their size, in the budget's unit only when that
    # does not round it away (2 TB for 28 MB of experts)
    shown = fmt_bytes(min(budget, total), unit)
    if budget > total and float(shown.split()[0]) * 100 < 1:
        shown = fmt_bytes(total)
    cache = (
        f"{shown} of MLX memory for resident experts "
        f"({100 * min(budget, total) / max(total, 1):.0f}% of them; {given_as})"
    )
    short = too_small(layout, budget, top_k_of(config))
    if short is not None:  # every call would go to staging: say so, not just the share
        cache += f"; {short.describe(lambda n: fmt_bytes(n, unit))}"
    by_layer: Sequence[object]
    try:
        backend = select_backend(options.backend)
        picked = backend_report(backend)
    except Exception as e:  # noqa: BLE001 - e.g. kernels missing on this build: info still useful
        picked = f"unavailable ({type(e).__name__}: {e})"
        by_layer = [picked]
    else:
        try:
            by_layer = layer_backends(config, layout, backend, path)
        except Exception as e:  # noqa: BLE001 - a model mlx-lm cannot build: the rest still holds
            by_layer = [f"unknown ({type(e).__name__}: {e})"]

    return [
        ("model", str(path)),
        (
            "model_type",
            f"{config.get('model_type')}"
            + (f" (text: {text.get('model_type')})" if text is not config else ""),
        ),
        (
            "format",
            "converted (packed_experts/, one file per MoE layer)"
            if packed
            else "mlx-lm checkpoint (experts read from the safetensors; `convert` packs them)",
        ),
        (
            "layers",
            f"{text.get('num_hidden_layers', '?')}, of which {len(layers)} MoE ({_ranges(layers)})",
        ),
        ("experts per layer", one_or_all(x.num_experts for x in lay)),
        ("top-k", str(text.get("num_experts_per_tok", "?"))),
        ("expert quantization", one_or_all(quant(x.quantization) for x in lay)),
        ("expert blob", one_or_all(f"{x.blob_size:,} bytes" for x in lay)),
        ("experts, total", f"{fmt_bytes(total)} ({total:,} bytes)"),
        ("dense weights", fmt_bytes(dense)),
        ("RAM", f"{fmt_bytes(ram.total)} total, {fmt_bytes(ram.available)} available"),
        ("expert I/O", f"{mode} ({why})"),
        ("expert cache", cache),
        (
            MACHINE_HEADING,
            machine_choices(options.tuning, max(x.num_experts * x.blob_size for x in lay)),
        ),
        ("backend", f"{picked} ({options.backend}, device {device_name()})"),
        ("backend by layer", list(by_layer)),
    ]


def _ranges(ids: list) -> str:
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def _json_value(value):
    if isinstance(value, str):
        return value
    if value and isinstance(value[0], tuple):  # (what, choice) pairs
        return dict(value)
    return [
        dict(asdict(v), label=v.label, text=str(v)) if isinstance(v, LayerGroup) else str(v)
        for v in value
    ]


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model_path)
    rows = describe(path, load_kwargs(args))
    if args.json:
        print(json.dumps({k: _json_value(v) for k, v in rows}, indent=1))
        return 0
    # the pairs of a group: a heading, then one indented row each
    flat: list = []
    for k, v in rows:
        if v and isinstance(v, list) and isinstance(v[0], tuple):
            flat.append((k, MACHINE_NOTE))
            flat += [(f"  {what}", why) for what, why in v]
        else:
            flat.append((k, v))
    width = max(len(k) for k, _ in flat)
    for k, v in flat:
        lines = [v] if isinstance(v, str) else [str(x) for x in v]
        print(f"{k:<{width}}  {lines[0]}")
        for line in lines[1:]:  # one group of layers a line, under the first
            print(f"{'':<{width}}  {line}")
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_path",
        metavar="MODEL",
        nargs="?",
        default=None,
        help="converted directory or mlx-lm checkpoint (default: the built-in demo model)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the same as one JSON object (the per-layer backends as a list of groups)",
    )
    add_load_args(p)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("info", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
