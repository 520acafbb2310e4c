"""The decode benchmark's research results: more columns, summary lines and notes on the
product's report (``moeflux_mlx.measure``: the table, the JSON, markdown and PNG files)."""

from __future__ import annotations

from pathlib import Path
from typing import List

from benchmarks.lib.trace_routing import REPLAYED_ROUTING
from moeflux_mlx import measure

CEILING = "moeflux experts skipped (ceiling)"


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
    ("sync_ms_per_token", "sync ms/tok", "{:.2f}"),
    ("io_ms_per_token", "io ms/tok", "{:.2f}"),
    ("checksum_of_io", "CRC of io", "{:.1%}"),
    ("checksum_of_decode", "CRC of decode", "{:.1%}"),
    ("checksum_since_load_mb", "CRC MB since load", "{:.1f}"),
    ("checksum_since_load_s", "CRC s since load", "{:.3f}"),
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
    return measure.format_table(result, COLUMNS)


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


CHECKSUMS = (
    "CRC of io, CRC of decode: the time of the store's CRC-32 checks of experts read for the "
    "first time, during the timed decode, as a share of its read time (io ms/tok, which holds "
    "the checks of the reads it waited for; a whole layer read ahead in the background is "
    "checked there) and of its decode time. CRC MB and s since load: every check since the "
    "model was loaded, the cache's fill, the warm-up and the timed prompt included (each expert "
    "is checked once, at its first read; plain checkpoints record no checksums: 0)."
)


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


def write_results(result: dict, out_dir: Path, stem: str) -> List[Path]:
    """``measure.write_results`` with the research columns, the disk's rates, how the cold runs
    were cold, and the summary lines."""
    notes = [
        "Up to 256 distinct experts at random, read by the store (8 threads) one call per layer "
        "for up to 32 of them, the faster of through the page cache and uncached: cold "
        f"{result['cold_read_gb_s']:.2f} GB/s; from the page cache "
        f"{result.get('page_cache_read_gb_s', float('nan')):.2f} GB/s. The I/O bound of a cold "
        "run uses its own cold figure (cold GB/s: the mean of the same measurement right before "
        "and right after its timed decode); other runs use this one.",
        cold_runs(result.get("page_cache", "dropped")),
        CHECKSUMS,
    ]
    return measure.write_results(
        result, out_dir, stem, columns=COLUMNS, notes=notes, summary=summary_lines(result)
    )
