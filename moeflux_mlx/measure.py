"""Decode timed against stock mlx-lm, in one process: greedy decode of one prompt by stock
mlx-lm's model and by moeflux-mlx's at several cache budgets, one after the other, and the report
(a table, JSON, markdown, and a plot when matplotlib is installed).

``moeflux-mlx bench`` runs ``run_bench``. The benchmarks (``benchmarks/lib/decode.py``) build their
research runs on the same pieces: ``run_moeflux`` with a ``Timing`` of their own around the timed
decode, a subclass of ``DecodeRun`` for what else they measure, and ``write_results`` with more
columns and notes.
"""

from __future__ import annotations

import gc
import json
import logging
import platform
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import psutil
from mlx_lm.generate import generate_step

from .compute.selfcheck import MLX_VERSION
from .format.checkpoint import expert_layout, is_packed
from .io.bandwidth import expert_files
from .model.load import load

log = logging.getLogger(__name__)

STOCK = "stock mlx-lm"
WARM_UP_TOKENS = 4


@dataclass
class DecodeRun:
    """One configuration's timed decode (``asdict`` is its JSON row; ``tokens`` stays out)."""

    name: str
    io_mode: str = "-"
    budget: str = "-"  # share of the experts held in the cache
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    decode_tokens: int = 0
    decode_tps: float = 0.0
    ratio_to_stock: Optional[float] = None
    experts_read_per_token: float = 0.0
    mb_read_per_token: float = 0.0
    hit_rate: Optional[float] = None
    sync_ms_per_token: float = 0.0  # waiting for router indices: device compute before them too
    io_ms_per_token: float = 0.0
    upload_ms_per_token: float = 0.0
    # the store's first-read CRC-32 checks of a converted model's experts during the decode:
    # their time (inside io ms/tok, but where a background read hides it) and bytes; the miss
    # server's, in a process of its own, are not counted
    checksum_ms_per_token: float = 0.0
    checksum_mb_per_token: float = 0.0
    peak_memory_gb: float = 0.0
    tokens: List[int] = field(default_factory=list, repr=False)

    def label(self) -> str:
        """What tells this configuration from the others of one result."""
        return f"{self.name} {self.io_mode} {self.budget}"


def timed_greedy(model, prompt: mx.array, decode_tokens: int, on_first=None):
    """Greedy decode of ``decode_tokens`` tokens after the first, timed.

    Args:
        model: an mlx-lm model.
        prompt: the prompt's token ids.
        decode_tokens: tokens decoded after the first (the end of prefill).
        on_first: called after the first token, before decode timing starts.

    Returns:
        ``(tokens, log-probs, prefill seconds, decode seconds)``: every token, the first
        included, and each step's log-probs, left on the device (copied out by the caller
        after the timed loop, if at all).
    """
    mx.synchronize()
    t0 = time.perf_counter()
    gen = generate_step(prompt, model, max_tokens=decode_tokens + 1)
    tok, lp = next(gen)
    tokens, logprobs = [int(tok)], [lp]
    t1 = time.perf_counter()
    if on_first:
        on_first()
    t2 = time.perf_counter()
    for tok, lp in gen:
        tokens.append(int(tok))
        logprobs.append(lp)
    mx.synchronize()
    return tokens, logprobs, t1 - t0, time.perf_counter() - t2


def time_generation(model, prompt: mx.array, decode_tokens: int, on_first=None):
    """``timed_greedy`` as rates: ``(prompt tok/s, decode tok/s, tokens, decode seconds)``."""
    tokens, _, prefill_s, decode_s = timed_greedy(model, prompt, decode_tokens, on_first)
    return prompt.size / prefill_s, (len(tokens) - 1) / decode_s, tokens, decode_s


def as_is(model) -> None:
    """A ``prepare`` hook that leaves the model as loaded."""


def _release() -> None:
    gc.collect()
    mx.clear_cache()


def run_stock(
    path, prompt: mx.array, decode_tokens: int, prepare=as_is, run_type=DecodeRun
) -> DecodeRun:
    """Stock mlx-lm's timed decode of ``prompt`` after a short warm-up.

    Args:
        path: a plain mlx-lm checkpoint.
        prompt: the prompt's token ids.
        decode_tokens: tokens decoded after the first.
        prepare: called on the model right after it is loaded.
        run_type: ``DecodeRun`` or a subclass of it.

    Returns:
        The run, named ``STOCK``.
    """
    import mlx_lm

    model = mlx_lm.load(str(path))[0]
    prepare(model)
    time_generation(model, prompt, WARM_UP_TOKENS)  # kernels of these shapes, the allocator
    mx.reset_peak_memory()
    ptps, dtps, tokens, _ = time_generation(model, prompt, decode_tokens)
    run = run_type(
        STOCK,
        prompt_tokens=prompt.size,
        prompt_tps=ptps,
        decode_tokens=len(tokens) - 1,
        decode_tps=dtps,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        tokens=tokens,
    )
    del model
    _release()
    return run


class Timing:
    """Hooks around the timed part of ``run_moeflux`` (this one does nothing): entered after the
    warm-up, before the timed prompt; ``start`` when the timed decode starts (after the first
    token); left after the decode; then ``finish`` adds what it measured to the run, before the
    model is closed."""

    def __enter__(self) -> Timing:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def start(self) -> None:
        """The timed decode starts."""

    def finish(self, run: DecodeRun, model, decode_s: float) -> None:
        """Adds to ``run`` what was measured (``model.moeflux``'s counters cover the decode)."""


def run_moeflux(
    model,
    prompt: mx.array,
    decode_tokens: int,
    budget_fraction: float,
    *,
    run_type=DecodeRun,
    timing: Optional[Timing] = None,
) -> DecodeRun:
    """A moeflux model's timed decode of ``prompt`` after a short warm-up, with its streaming
    counters per token; the model's runtime is closed at the end.

    Args:
        model: a model from ``moeflux_mlx.load``.
        prompt: the prompt's token ids.
        decode_tokens: tokens decoded after the first.
        budget_fraction: the share of the experts the model's cache was given (for the name).
        run_type: ``DecodeRun`` or a subclass of it (more fields for ``timing`` to fill).
        timing: hooks around the timed part (default: none).

    Returns:
        The run, named ``moeflux BACKEND``.
    """
    timing = timing or Timing()
    rt = model.moeflux
    try:
        time_generation(model, prompt, WARM_UP_TOKENS)  # kernels, the allocator, the fills
        checks_from = rt.store.checksum_cost()

        def on_first() -> None:  # the timed decode starts: its counters from zero
            nonlocal checks_from
            rt.reset_stats()
            checks_from = rt.store.checksum_cost()
            timing.start()

        with timing:
            mx.reset_peak_memory()
            rt.reset_stats()
            ptps, dtps, tokens, decode_s = time_generation(model, prompt, decode_tokens, on_first)
            checks_to = rt.store.checksum_cost()
            rt.stats_dict()  # counts what the miss server read, if any
        t = rt.stats.total()
        n = max(len(tokens) - 1, 1)
        run = run_type(
            f"moeflux {rt.backend.name}",
            io_mode=rt.store.io_mode,
            budget=f"{budget_fraction:.0%}",
            prompt_tokens=prompt.size,
            prompt_tps=ptps,
            decode_tokens=n,
            decode_tps=dtps,
            experts_read_per_token=t.experts_read / n,
            mb_read_per_token=t.bytes_read / n / 1e6,
            hit_rate=rt.stats.hit_rate if t.experts_routed else None,
            sync_ms_per_token=1e3 * t.sync_s / n,
            io_ms_per_token=1e3 * t.io_s / n,
            upload_ms_per_token=1e3 * t.upload_s / n,
            checksum_ms_per_token=1e3 * (checks_to[0] - checks_from[0]) / n,
            checksum_mb_per_token=(checks_to[1] - checks_from[1]) / n / 1e6,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            tokens=tokens,
        )
        timing.finish(run, model, decode_s)
        return run
    finally:
        rt.close()
        _release()


def cache_budget(path, budget_fraction: float):
    """``load``'s ``cache_budget`` for a share of ``path``'s experts (``"all"`` at 1)."""
    if budget_fraction >= 1:
        return "all"
    return int(budget_fraction * expert_layout(Path(path)).total_expert_bytes)


def fits_for_stock(path: Path) -> bool:
    """Whether stock mlx-lm can load ``path`` with room to spare (0.8 x available memory)."""
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    weights += sum(f.stat().st_size for f in expert_files(path)) if is_packed(path) else 0
    return weights < 0.8 * psutil.virtual_memory().available


def can_run_stock(path: Path) -> bool:
    """Stock mlx-lm runs ``path``: a plain checkpoint that fits (a warning says why not)."""
    if not is_packed(path) and fits_for_stock(path):
        return True
    log.warning("stock mlx-lm skipped: %s is a converted directory or does not fit in memory", path)
    return False


def make_prompt(prompt_tokens: int, prompt: Optional[Sequence[int]] = None, seed: int = 0):
    """The prompt: the first ``prompt_tokens`` of ``prompt``, or random ids below 256 (a
    random-weight model has no text to be given)."""
    mx.random.seed(seed)
    if prompt is None:
        return mx.random.randint(0, 256, (prompt_tokens,)).astype(mx.uint32)
    return mx.array(list(prompt)[:prompt_tokens], dtype=mx.uint32)


def result_dict(path, runs: List[DecodeRun], **extra) -> dict:
    """The result of ``runs`` (stock's first, if it ran): each run's ratio to stock set, and
    whether each decoded stock's greedy tokens; ``extra`` joins the dict."""
    ref = runs[0] if runs and runs[0].name == STOCK else None
    for r in runs:
        if ref is not None:
            r.ratio_to_stock = r.decode_tps / ref.decode_tps
    same = None if ref is None else {r.label(): r.tokens == ref.tokens for r in runs[1:]}
    return {
        **extra,
        "model": str(path),
        "machine": machine_name(),
        "mlx": MLX_VERSION,
        "device": str(mx.default_device()),
        "tokens_identical_to_stock": same,
        "runs": [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in runs],
    }


def run_bench(
    path,
    *,
    budgets: Sequence[float] = (1.0, 0.5, 0.25),
    prompt_tokens: int = 128,
    decode_tokens: int = 64,
    expert_io: Optional[str] = None,
    stock: bool = True,
    stock_path=None,
    prompt: Optional[Sequence[int]] = None,
    progress: Callable[[str], None] = lambda line: None,
) -> dict:
    """Stock mlx-lm, then moeflux at each cache budget, each timed decoding the same prompt.

    The page cache is left as the OS keeps it: a model larger than RAM reads from the disk, one
    that fits soon reads from memory, as it would for its user.

    Args:
        path: the checkpoint moeflux streams from (plain or converted).
        budgets: shares of the experts held in the cache, each in [0, 1].
        prompt_tokens: the prompt's length.
        decode_tokens: tokens decoded after the first.
        expert_io: how experts are read (``load``'s ``expert_io``; None: the RAM gate).
        stock: also run stock mlx-lm (where the checkpoint is plain and fits in memory).
        stock_path: what stock mlx-lm loads (default: ``path``).
        prompt: token ids to start from (default: random ids).
        progress: called with one line as each configuration starts.

    Returns:
        The result: ``runs`` (one row each, ``ratio_to_stock`` filled where stock ran), the
        machine, the versions; ``write_results`` writes it.

    Raises:
        MoefluxError: the checkpoint cannot be loaded (``load``'s errors).
    """
    path = Path(path)
    stock_path = Path(stock_path or path)
    ids = make_prompt(prompt_tokens, prompt)
    runs: List[DecodeRun] = []
    with_stock = stock and can_run_stock(stock_path)
    total = len(budgets) + with_stock
    if with_stock:
        progress(f"[1/{total}] stock mlx-lm ...")
        runs.append(run_stock(stock_path, ids, decode_tokens))
    for k, frac in enumerate(budgets, start=1 + with_stock):
        progress(f"[{k}/{total}] moeflux, {frac:.0%} of the experts cached ...")
        model, _ = load(path, expert_io=expert_io, cache_budget=cache_budget(path, frac))
        runs.append(run_moeflux(model, ids, decode_tokens, frac))
        del model
    return result_dict(path, runs)


# ---------------------------------------------------------------------------------------------
# the report


def machine_name() -> str:
    """The GPU(s), if any, and the CPU: ``"NVIDIA H100 80GB HBM3, x86_64 26 cores 221 GiB"``."""
    gpu = ""
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        try:
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


# (run field, column title, format)
COLUMNS = [
    ("name", "config", "{}"),
    ("io_mode", "io", "{}"),
    ("budget", "cache", "{}"),
    ("prompt_tps", "prompt tok/s", "{:.1f}"),
    ("decode_tps", "decode tok/s", "{:.2f}"),
    ("ratio_to_stock", "x stock", "{:.2f}"),
    ("mb_read_per_token", "MB read/tok", "{:.1f}"),
    ("hit_rate", "hit", "{:.0%}"),
    ("io_ms_per_token", "io ms/tok", "{:.2f}"),
    ("peak_memory_gb", "peak GB", "{:.2f}"),
]


def format_table(result: dict, columns: Sequence[Tuple[str, str, str]] = COLUMNS) -> str:
    """The runs as a markdown table of ``columns``; a value that is None or missing is ``-``."""
    head = "| " + " | ".join(c[1] for c in columns) + " |"
    lines = [head, "|" + "---|" * len(columns)]
    for r in result["runs"]:
        cells = [("-" if r.get(k) is None else f.format(r[k])) for k, _, f in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def write_results(
    result: dict,
    out_dir: Path,
    stem: str,
    *,
    columns: Sequence[Tuple[str, str, str]] = COLUMNS,
    notes: Sequence[str] = (),
    summary: Sequence[str] = (),
) -> List[Path]:
    """Write ``STEM.json``, ``STEM.md`` and, with matplotlib, ``STEM.png`` (decode tok/s by
    budget, one line per configuration and I/O mode, stock's as a level) into ``out_dir``.

    Args:
        result: ``run_bench``'s (or a benchmark's) result.
        out_dir: the folder (made if missing).
        stem: the files' name; ``-2``, ``-3``, ... is added when a result of that name exists,
            so nothing is overwritten.
        columns: the markdown table's.
        notes: paragraphs before the table.
        summary: lines after it.

    Returns:
        The files written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = free_stem(out_dir, stem)
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    written[0].write_text(json.dumps(result, indent=1))
    md = [
        f"# Decode benchmark: {Path(result['model']).name}",
        "",
        f"Machine: {result['machine']}; MLX {result['mlx']} ({result['device']}).",
        *notes,
        "",
        format_table(result, columns),
        "",
    ]
    md += [line if line.endswith(".") else line + "." for line in summary]
    if result["tokens_identical_to_stock"] is not None:
        same = result["tokens_identical_to_stock"]
        md.append(
            f"Greedy tokens identical to stock mlx-lm: {sum(same.values())}/{len(same)} runs."
        )
    written[1].write_text("\n".join(md) + "\n")
    if plot_unavailable():
        log.info("no plot: %s", plot_unavailable())
        return written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict = {}
    for r in result["runs"]:
        if r["budget"] != "-":
            series.setdefault(f"{r['name']} {r['io_mode']}", []).append(r)
    for label, rs in series.items():
        ax.plot(
            [float(r["budget"].rstrip("%")) for r in rs],
            [r["decode_tps"] for r in rs],
            marker="o",
            label=label,
        )
    stock = [r for r in result["runs"] if r["name"] == STOCK]
    if stock:
        ax.axhline(stock[0]["decode_tps"], color="gray", linestyle="--", label=STOCK)
    ax.set_xlabel("expert cache budget (% of experts)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(result["machine"], fontsize=8)
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / f"{stem}.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written
