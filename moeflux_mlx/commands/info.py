"""``moeflux-mlx info``: what would stream from a model and how: MoE layers, experts, sizes, the
RAM gate's choice, the cache budget and the backend."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import psutil

from ..compute.backend import backend_report, select_backend
from ..format.checkpoint import is_packed, packed_layout, read_config, scan_checkpoint
from ..format.safetensors import index_directory
from ..io.store import RAM_FRACTION, open_store, select_expert_io
from ..options import LoadOptions, budget_unit, parse_budget
from .common import (
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


def describe(path: Path, given: Optional[dict] = None) -> list:
    """``(label, value)`` rows saying what would stream from ``path`` and how.

    Args:
        path: a converted directory or an mlx-lm checkpoint.
        given: the load options given on the command line (``common.load_kwargs``).

    Returns:
        ``[(label, value), ...]``.

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
    mode = select_expert_io(total, options.expert_io)
    source = options.source("expert_io", given)
    if source.startswith("--"):
        why = f"requested: {source} {options.expert_io}"
    elif source != "default":
        why = f"requested: {source}"
    else:
        cmp = ">" if total > RAM_FRACTION * ram.total else "<="
        why = (
            f"auto: experts {fmt_bytes(total)} {cmp} {RAM_FRACTION} x RAM "
            f"{fmt_bytes(ram.total)} = {fmt_bytes(RAM_FRACTION * ram.total)}"
        )
    budget = parse_budget(options.cache_budget, total)  # valid: LoadOptions.resolve checked it
    unit = budget_unit(options.cache_budget)  # sizes in the units the budget was given in
    if options.cache_budget is None:
        given_as = "default"
    else:
        given_as = f"--cache-budget {fmt_budget(options.cache_budget, total)}"
    cache = (
        f"{fmt_bytes(min(budget, total), unit)} of MLX memory for resident experts "
        f"({100 * min(budget, total) / max(total, 1):.0f}% of them; {given_as})"
    )
    try:
        picked = backend_report(select_backend(options.backend))
    except Exception as e:  # noqa: BLE001 - e.g. kernels missing on this build: info still useful
        picked = f"unavailable ({type(e).__name__}: {e})"

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
        ("backend", f"{picked} ({options.backend}, device {device_name()})"),
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


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model_path)
    rows = describe(path, load_kwargs(args))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_path",
        metavar="MODEL",
        nargs="?",
        default=None,
        help="converted directory or mlx-lm checkpoint (default: the demo checkpoint)",
    )
    add_load_args(p)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("info", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
