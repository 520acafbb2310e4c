"""The decode benchmark's results: the machine's name, a table, summary lines, and the files
(JSON, markdown, a PNG when matplotlib is installed)."""

from __future__ import annotations

import json
import logging
import platform
import re
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import psutil

from .trace_routing import REPLAYED_ROUTING

CEILING = "moeflux experts skipped (ceiling)"

log = logging.getLogger(__name__)


def machine_name() -> str:
    gpu = ""
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        try:
            import subprocess

            names = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.splitlines()
            names = [n.strip() for n in names if n.strip()]
        except (OSError, subprocess.SubprocessError):
            names = []
        # one line per GPU: "2 x NVIDIA H100 80GB HBM3" on a machine of two
        gpu = (
            (names[0] if len(names) == 1 else f"{len(names)} x {names[0]}") if names else "CUDA GPU"
        )
    cpu = f"{platform.machine()} {psutil.cpu_count()} cores {psutil.virtual_memory().total / 2**30:.0f} GiB"
    return f"{gpu}, {cpu}" if gpu else cpu


def machine_tag(machine: str) -> str:
    """A short name for result files: ``h100`` for "NVIDIA H100 80GB HBM3, ...", ``h100x2`` for
    "2 x NVIDIA H100 80GB HBM3, ...", ``cpu2``."""
    gpu = machine.split(",")[0] if "," in machine else ""
    count = re.match(r"(\d+) x (.*)", gpu)
    if count:
        return f"{machine_tag(count.group(2) + ',')}x{count.group(1)}"
    words = [
        w
        for w in gpu.split()
        if w.upper() not in ("NVIDIA", "TESLA", "GEFORCE") and not w.upper().endswith("GB")
    ]
    return words[0].lower() if words else f"cpu{psutil.cpu_count()}"


COLUMNS = [
    ("name", "config", "{}"),
    ("io_mode", "io", "{}"),
    ("budget", "cache", "{}"),
    ("lookup", "lookup", "{}"),
    ("prompt_tps", "prompt tok/s", "{:.1f}"),
    ("decode_tps", "decode tok/s", "{:.2f}"),
    ("ratio_to_stock", "x stock", "{:.2f}"),
    ("mb_read_per_token", "MB read/tok", "{:.1f}"),
    ("disk_mb_per_token", "disk MB/tok", "{:.1f}"),
    ("hit_rate", "hit", "{:.0%}"),
    ("prefetch_issued_per_token", "read ahead/tok", "{:.1f}"),
    ("prefetch_hits_per_token", "prefetched/tok", "{:.1f}"),
    ("sync_ms_per_token", "sync ms/tok", "{:.2f}"),
    ("io_ms_per_token", "io ms/tok", "{:.2f}"),
    ("upload_ms_per_token", "upload ms/tok", "{:.2f}"),
    ("gpu_waits_per_token", "GPU waits/tok", "{:.2f}"),
    ("gpu_wait_ms_per_token", "GPU wait ms/tok", "{:.2f}"),
    ("other_ms_per_token", "rest ms/tok", "{:.2f}"),
    ("cold_gb_s", "cold GB/s", "{:.2f}"),
    ("io_bound_tps", "I/O bound tok/s", "{:.1f}"),
    ("fraction_of_io_bound", "of bound", "{:.0%}"),
    ("page_cache_mb", "page cache MB", "{:.0f}"),
    ("ram_held_gb", "RAM held GB", "{:.1f}"),
    ("peak_memory_gb", "peak GB", "{:.2f}"),
]


def format_table(result: dict) -> str:
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in result["runs"]:
        cells = [("-" if r.get(k) is None else f.format(r[k])) for k, _, f in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_lines(result: dict) -> List[str]:
    out = []
    if result.get("routing_trace"):
        out.append(
            f"Routing replayed from {result['routing_trace']} (every MoE layer's router replaced): "
            + REPLAYED_ROUTING
        )
    for key, what in (
        (
            "sync_overhead_ms_per_layer",
            "host sync (99% budget, nearly all hits, the misses' reads included",
        ),
        (
            "device_lookup_overhead_ms_per_layer",
            "device-side table (99% budget, nearly all hits, the misses' reads and waits included",
        ),
        (
            "device_lookup_only_ms_per_layer",
            "device-side table alone (100% budget, every expert resident and looked up",
        ),
    ):
        if result.get(key) is not None:
            note = " (negative: within run-to-run noise)" if result[key] < 0 else ""
            out.append(
                f"Slot lookup overhead per MoE layer, {what}; vs 100% looking nothing "
                f"up): {result[key]:.3f} ms{note}"
            )
    out += [f"FAILED: {f}" for f in result.get("failures", [])]
    paired = result.get("paired_resident")
    if paired:
        line = (
            f"All experts resident vs stock, all loaded in one process and decoding in turn, "
            f"{paired['rounds']} rounds: stock "
            + ", ".join(f"{v:.3g}" for v in paired["stock_tps"])
            + " tok/s"
        )
        for name, r in paired["moeflux"].items():
            line += (
                f"; {name} "
                + ", ".join(f"{v:.3g}" for v in r["tps"])
                + f" tok/s, median ratio to stock {r['median_ratio']:.2f}x"
            )
        out.append(line)
        ceiling = paired["moeflux"].get(CEILING)
        if ceiling is not None:
            out.append(
                "Ceiling: with the experts' computation skipped (no weight read, no kernel), "
                f"the rest of the model decodes at {ceiling['median_ratio']:.2f}x stock; "
                "no expert kernel can make this model faster than that."
            )
        if paired.get("table_lookup_ms_per_layer") is not None:
            out.append(
                "Slot lookup overhead per MoE layer, device-side table alone, from those "
                "rounds (the kernels with and without every expert looked up, median): "
                f"{paired['table_lookup_ms_per_layer']:.3f} ms"
            )
    return out


# how the cold runs were cold, by run_benchmark's page_cache
COLD_RUNS = {
    "dropped": "Budgets below 100% run cold: during pread and direct runs a separate process "
    "keeps dropping the expert files from the page cache (as if the experts were many times "
    "RAM); mmap runs are cold only at their start (mapped pages cannot be dropped).",
    "kept": "Budgets below 100% start cold (the expert files dropped from the page cache), then "
    "the page cache keeps what RAM lets it keep; 'page cache MB' says how much of the experts "
    "it held at the end, 'disk MB/tok' what the disk read, and the I/O bound is the disk's "
    "(its cold rate for what it read).",
}


def cold_runs(page_cache) -> str:
    """How the cold runs were cold (run_benchmark's ``page_cache``: a name, or a share)."""
    if isinstance(page_cache, str):
        return COLD_RUNS[page_cache]
    return (
        COLD_RUNS["kept"]
        + f" Meanwhile another process held all of RAM but {page_cache:.0%} of the experts' "
        f"bytes ('RAM held GB'), as for experts {1 / page_cache:.1f}x the RAM left to the page "
        "cache (at most: other files' cached pages share what is left)."
    )


RESULT_SUFFIXES = (".json", ".md", ".png")


def free_stem(out_dir: Path, stem: str) -> str:
    """``stem``, or ``stem-2``, ``stem-3``, ...: the first for which no result file exists in
    ``out_dir``, so that a result is never overwritten (two runs on one day)."""
    candidate, n = stem, 1
    while any((Path(out_dir) / f"{candidate}{suffix}").exists() for suffix in RESULT_SUFFIXES):
        n += 1
        candidate = f"{stem}-{n}"
    return candidate


def plot_unavailable() -> Optional[str]:
    """Why ``write_results`` will not draw the PNG, None when it will."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "matplotlib is not installed (pip install matplotlib, or the package's [bench] extra)"
        )
    return None


def write_results(result: dict, out_dir: Path, stem: str) -> List[Path]:
    """Write ``STEM.json``, ``STEM.md`` and, with matplotlib, ``STEM.png`` into ``out_dir``;
    ``STEM`` gets a suffix (``-2``, ...) when a result of that name exists: nothing is
    overwritten. Returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = free_stem(out_dir, stem)
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    written[0].write_text(json.dumps(result, indent=1))
    md = [
        f"# Decode benchmark: {Path(result['model']).name}",
        "",
        f"Machine: {result['machine']}; MLX {result['mlx']} ({result['device']}).",
        "Up to 256 distinct experts at random, read by the store (8 threads) one call per layer "
        "for up to 32 of them, the faster of through the page cache and uncached: cold "
        f"{result['cold_read_gb_s']:.2f} GB/s; from the page cache "
        f"{result.get('page_cache_read_gb_s', float('nan')):.2f} GB/s. The I/O bound of a cold "
        "run uses its own cold figure (cold GB/s: the mean of the same measurement right before "
        "and right after its timed decode); other runs use this one.",
        cold_runs(result.get("page_cache", "dropped")),
        "",
        format_table(result),
        "",
    ]
    md += [line if line.endswith(".") else line + "." for line in summary_lines(result)]
    if result["tokens_identical_to_stock"] is not None:
        same = result["tokens_identical_to_stock"]
        md.append(
            f"Greedy tokens identical to stock mlx-lm: {sum(same.values())}/{len(same)} runs."
        )
    written[1].write_text("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("no plot: %s", plot_unavailable())
        return written
    fig, ax = plt.subplots(figsize=(6, 4))
    for io_mode in sorted({r["io_mode"] for r in result["runs"] if r["io_mode"] != "-"}):
        rs = [r for r in result["runs"] if r["io_mode"] == io_mode]
        for pf in (False, True):
            sel = [r for r in rs if r["name"].endswith("+prefetch") == pf or r["budget"] == "100%"]
            if pf and len(sel) <= 1:
                continue
            ax.plot(
                [float(r["budget"].rstrip("%")) for r in sel],
                [r["decode_tps"] for r in sel],
                marker="o",
                label=f"moeflux {io_mode}" + (" +prefetch" if pf else ""),
            )
    stock = [r for r in result["runs"] if r["name"].startswith("stock")]
    if stock:
        ax.axhline(stock[0]["decode_tps"], color="gray", linestyle="--", label="stock mlx-lm")
    ax.set_xlabel("expert cache budget (% of experts)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(result["machine"], fontsize=8)
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / f"{stem}.png")
    fig.savefig(written[-1], dpi=120)
    return written
