"""``moeflux-mlx compare``: is the streaming model the same model as stock mlx-lm's, and how fast?

Loads the checkpoint with ``mlx_lm.load`` and runs a few prompts greedily, frees it, loads it with
``moeflux_mlx.load`` and runs the same prompt tokens; then compares the generated tokens and the
full log-prob vectors of every step up to (and including) the first divergence.

On the CPU backend the two must agree exactly (identical tokens, every log-prob equal). On a GPU
the tokens must be identical and each step's distribution within ``--kl-tol`` of stock's (the KL
divergence; the fused kernels round bf16 sums in another order, which moves the log-probs of
unlikely tokens by as much as stock's own rounding does: docs/results.md, "Correctness"), and,
if given, every log-prob within ``--logprob-tol``. Exit status: 0 same, 1 different, 2 error, 3
stock mlx-lm was not run (the model does not fit in memory; ``--force``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx
import mlx_lm
import numpy as np
import psutil
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..errors import CheckpointError
from ..format.checkpoint import is_packed, packed_layout, scan_checkpoint
from ..io.store import open_store
from ..model.load import load
from ..options import LoadOptions
from .common import (
    add_load_args,
    command_parser,
    device_name,
    expert_summary,
    float_in,
    fmt_bytes,
    load_kwargs,
    main_for,
    positive_int,
    prompt_tokens,
    resolve_model,
    say,
)

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = (  # the kinds of request the demo model was trained to answer
    "Tell me something wise.",
    'What does "harbor" mean?',
    "Continue this story: It is a truth universally acknowledged, that a single man in "
    "possession of a good fortune",
)
DEFAULT_MAX_TOKENS = 32
# Largest KL(stock || moeflux) per step accepted on a GPU, in nats. On the trained demo the
# kernels' distributions lay at most 1.3e-2 from float32's, stock's at most 0.9e-2
# (docs/results.md, "Correctness"); a wrong expert or scale moves them far more.
GPU_KL_TOL = 0.05
DESCRIPTION = (
    "run the same prompts greedily with stock mlx-lm and with moeflux-mlx; compare "
    "tokens, log-probs and speed"
)
# Stock mlx-lm reads every weight into memory: run it only when they fit in this share of what
# is available now, rather than send the machine into swap.
STOCK_MEMORY_FRACTION = 0.9
EXIT_SAME, EXIT_DIFFERENT, EXIT_NOT_COMPARED = 0, 1, 3


@dataclass
class GreedyRun:
    """One greedy generation: tokens (EOS included), each step's log-probs, timings."""

    tokens: List[int]
    logprobs: List[np.ndarray]
    prompt_s: float
    decode_s: float

    @property
    def tps(self) -> float:
        """Decode tokens per second (after the first token, like mlx-lm's generation_tps)."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


@dataclass
class Row:
    prompt: str
    same: int  # leading tokens identical
    total: int  # tokens of the longer output
    first_divergence: Optional[int]  # step index, None when identical
    max_dlogprob: float  # over the steps whose context was identical
    max_kl: float  # KL(stock || moeflux) in nats, largest over the same steps
    stock_tps: float
    moeflux_tps: float
    reply: str = ""  # moeflux's text, so a person can judge it too

    @property
    def identical(self) -> bool:
        return self.first_divergence is None


@dataclass
class Report:
    model: Path
    moeflux_model: Path
    rows: List[Row]
    stock_ran: bool
    tolerance: Optional[float]  # largest |Δ log-prob| accepted; None: not a criterion
    kl_tolerance: Optional[float]  # largest KL per step accepted; None: not a criterion
    device: str
    backend: str = ""
    expert_stats: dict = field(default_factory=dict)

    @property
    def max_dlogprob(self) -> float:
        return max((r.max_dlogprob for r in self.rows), default=0.0)

    @property
    def max_kl(self) -> float:
        return max((r.max_kl for r in self.rows), default=0.0)

    @property
    def passed(self) -> bool:
        return (
            self.stock_ran
            and all(r.identical for r in self.rows)
            and (self.tolerance is None or self.max_dlogprob <= self.tolerance)
            and (self.kl_tolerance is None or self.max_kl <= self.kl_tolerance)
        )


def greedy(model, prompt: Sequence[int], max_tokens: int, eos: set) -> GreedyRun:
    tokens, logprobs = [], []
    tic = time.perf_counter()
    first = tic
    for n, (token, lp) in enumerate(
        generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens)
    ):
        if n == 0:
            first = time.perf_counter()
        tokens.append(int(token))
        logprobs.append(np.array(lp.astype(mx.float32)))
        if token in eos:
            break
    end = time.perf_counter()
    return GreedyRun(tokens, logprobs, first - tic, end - first)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b|, where equal entries (also -inf = -inf) count 0 and NaN counts inf."""
    d = np.where(a == b, 0.0, np.abs(a.astype(np.float64) - b.astype(np.float64)))
    return float(np.nan_to_num(d, nan=np.inf).max(initial=0.0))


def kl_divergence(ref: np.ndarray, got: np.ndarray) -> float:
    """KL(ref || got) in nats for two log-prob vectors: 0 where ``ref`` gives no probability,
    inf where ``got`` gives none to a token ``ref`` gives some, and where either is NaN."""
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    if np.isnan(ref64).any() or np.isnan(got64).any():
        return math.inf
    p = np.exp(ref64)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (ref64 - got64), 0.0)
    return float(max(terms.sum(), 0.0))


def compare_runs(prompt: str, ref: GreedyRun, got: GreedyRun) -> Row:
    n = min(len(ref.tokens), len(got.tokens))
    div = next((i for i in range(n) if ref.tokens[i] != got.tokens[i]), None)
    if div is None and len(ref.tokens) != len(got.tokens):
        div = n
    # Up to the divergence both models saw the same context, so their log-probs are comparable.
    steps = n if div is None else min(div + 1, n)
    dlp = max((max_abs_diff(ref.logprobs[i], got.logprobs[i]) for i in range(steps)), default=0.0)
    kl = max((kl_divergence(ref.logprobs[i], got.logprobs[i]) for i in range(steps)), default=0.0)
    return Row(
        prompt,
        n if div is None else div,
        max(len(ref.tokens), len(got.tokens)),
        div,
        dlp,
        kl,
        ref.tps,
        got.tps,
    )


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def available_memory() -> int:
    return psutil.virtual_memory().available


def _release_memory() -> None:
    gc.collect()
    mx.clear_cache()


def _run_all(
    model, prompts: List[List[int]], max_tokens: int, eos: set, side: str = ""
) -> List[GreedyRun]:
    """Each prompt greedily after a warm-up; a status line per prompt (``side: prompt 2/3 ...``)
    as it starts, so that a slow model is not silent for minutes."""
    greedy(model, prompts[0], 2, eos)  # warm-up (compiled functions), so speeds compare fairly
    runs = []
    for i, p in enumerate(prompts, 1):
        say(f"{side}: prompt {i}/{len(prompts)} ({len(p)} tokens, up to {max_tokens} more) ...")
        runs.append(greedy(model, p, max_tokens, eos))
    return runs


def check_models(model_path: Path, moeflux_path: Path, load_options: Optional[dict]) -> None:
    """What ``compare`` checks before stock mlx-lm runs (it may run for minutes): ``model_path``
    is an mlx-lm MoE checkpoint, ``moeflux_path`` a usable copy of its experts, the options valid.

    Raises:
        CheckpointError: not a directory, no config, not MoE, a converted MODEL, or a
            ``--converted`` directory whose experts are not MODEL's.
        ExpertFileError: an expert file of ``moeflux_path`` is missing or of the wrong size.
        OptionError: a bad load option (argument or ``MOEFLUX_*`` variable).
    """
    options = LoadOptions.resolve(**(load_options or {}))
    if is_packed(model_path):
        raise CheckpointError(
            f"{model_path}: a converted directory; stock mlx-lm cannot load it. "
            "Give the mlx-lm checkpoint it came from as MODEL and this "
            "directory as --converted"
        )
    layout = scan_checkpoint(model_path).layout  # config, headers, and routed experts at all
    if moeflux_path != model_path:
        if not moeflux_path.is_dir():
            what = "not a directory" if moeflux_path.exists() else "no such directory"
            raise CheckpointError(f"{moeflux_path}: {what} (--converted)")
        theirs = (
            packed_layout(moeflux_path)
            if is_packed(moeflux_path)
            else scan_checkpoint(moeflux_path).layout
        )
        if theirs.to_dict() != layout.to_dict():
            raise CheckpointError(
                f"{moeflux_path}: its experts are not {model_path}'s "
                f"({_layout_summary(theirs)} vs {_layout_summary(layout)}); "
                "--converted must be a conversion of MODEL"
            )
    # the expert files' sizes, as load() checks them, before stock mlx-lm spends its time
    open_store(moeflux_path, options.expert_io, 1)[0].close()


def _layout_summary(layout) -> str:
    layers = sorted(layout.layers)
    experts = sorted({layout.layers[i].num_experts for i in layers})
    blobs = sorted({layout.layers[i].blob_size for i in layers})
    return (
        f"{len(layers)} MoE layers, {'/'.join(map(str, experts))} experts, "
        f"{'/'.join(f'{b:,}' for b in blobs)}-byte experts"
    )


def compare(
    model_path,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    moeflux_path=None,
    load_options=None,
    force: bool = False,
    tolerance: Optional[float] = None,
    kl_tolerance: Optional[float] = None,
    use_chat_template: bool = True,
) -> Report:
    """Run ``prompts`` greedily on stock mlx-lm and on moeflux-mlx; return the comparison.

    Args:
        model_path: the mlx-lm checkpoint stock mlx-lm loads.
        prompts: the prompts, each run greedily on both.
        max_tokens: tokens to generate per prompt.
        moeflux_path: what moeflux-mlx loads instead of ``model_path`` (a converted copy).
        load_options: ``moeflux_mlx.load`` keyword arguments.
        force: run stock mlx-lm even when its weights do not fit in the memory available.
        tolerance: largest |Δ log-prob| accepted (default: 0 on the CPU, not a criterion on a
            GPU).
        kl_tolerance: largest KL(stock || moeflux) per step accepted (default: not a criterion
            on the CPU, where the log-probs must be equal; ``GPU_KL_TOL`` on a GPU).
        use_chat_template: render the prompts with the tokenizer's chat template.

    Returns:
        The report (``passed``: tokens identical and the tolerances met).

    Raises:
        CheckpointError: a model is not a usable MoE checkpoint (``check_models``).
    """
    model_path = Path(model_path)
    moeflux_path = Path(moeflux_path) if moeflux_path is not None else model_path
    check_models(model_path, moeflux_path, load_options)
    on_cpu = mx.default_device() == mx.cpu
    if tolerance is None and on_cpu:
        tolerance = 0.0
    if kl_tolerance is None and not on_cpu:
        kl_tolerance = GPU_KL_TOL
    report = Report(model_path, moeflux_path, [], False, tolerance, kl_tolerance, device_name())

    need, avail = checkpoint_bytes(model_path), available_memory()
    fits = need <= STOCK_MEMORY_FRACTION * avail
    stock_runs = tokens = None
    if fits or force:
        if not fits:
            say(
                f"--force: running stock mlx-lm although its {fmt_bytes(need)} of weights exceed "
                f"{STOCK_MEMORY_FRACTION:.0%} of the {fmt_bytes(avail)} available"
            )
        say(f"stock mlx-lm: loading {model_path} ({fmt_bytes(need)} of weights) ...")
        model, tokenizer = mlx_lm.load(str(model_path))[:2]  # no config: not asked for it
        tokens = [prompt_tokens(tokenizer, p, use_chat_template=use_chat_template) for p in prompts]
        eos = set(tokenizer.eos_token_ids)
        stock_runs = _run_all(model, tokens, max_tokens, eos, "stock mlx-lm")
        del model, tokenizer  # stock weights out of memory before the streaming model loads
        _release_memory()
        report.stock_ran = True
    else:
        say(
            f"Stock mlx-lm would read {fmt_bytes(need)} of weights into memory, but only "
            f"{fmt_bytes(avail)} is available: not running it (it would thrash; --force tries "
            "anyway). Running moeflux-mlx alone."
        )

    say(f"moeflux-mlx: loading {moeflux_path} ...")
    model, loaded = load(moeflux_path, **(load_options or {}))
    try:
        # load hands back mlx-lm's own tokenizer, though it promises only an object
        assert isinstance(loaded, TokenizerWrapper), type(loaded)
        tokenizer = loaded
        if tokens is None:
            tokens = [
                prompt_tokens(tokenizer, p, use_chat_template=use_chat_template) for p in prompts
            ]
        eos = set(tokenizer.eos_token_ids)
        model.moeflux.reset_stats()
        runs = _run_all(model, tokens, max_tokens, eos, "moeflux-mlx")
        stats = model.moeflux.stats_dict()
        report.backend = stats["backend"]
        report.expert_stats = dict(stats["total"], io_mode=stats["io_mode"])
    finally:
        model.moeflux.close()
    if stock_runs is None:
        report.rows = [
            Row(p, 0, len(r.tokens), None, 0.0, 0.0, float("nan"), r.tps)
            for p, r in zip(prompts, runs)
        ]
    else:
        report.rows = [compare_runs(p, a, b) for p, a, b in zip(prompts, stock_runs, runs)]
    for row, run in zip(report.rows, runs):
        row.reply = tokenizer.decode([t for t in run.tokens if t not in eos])
    return report


def _short(text: str, width: int = 32) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _num(x: Optional[float], fmt: str = ".1f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def _dlp(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def format_report(report: Report) -> str:
    rows = report.rows
    header = [
        "prompt",
        "tokens identical",
        "first divergence",
        "max |Δ log-prob|",
        "max KL",
        "mlx-lm tok/s",
        "moeflux tok/s",
        "ratio",
    ]
    table = []
    for r in rows:
        ratio = r.moeflux_tps / r.stock_tps if r.stock_tps and not math.isnan(r.stock_tps) else None
        if report.stock_ran:
            table.append(
                [
                    _short(r.prompt),
                    f"{r.same}/{r.total}",
                    "-" if r.identical else f"token {r.first_divergence}",
                    _dlp(r.max_dlogprob),
                    _dlp(r.max_kl),
                    _num(r.stock_tps),
                    _num(r.moeflux_tps),
                    _num(ratio, ".2f"),
                ]
            )
        else:
            table.append([_short(r.prompt), "-", "-", "-", "-", "-", _num(r.moeflux_tps), "-"])
    if report.stock_ran:
        same, total = sum(r.same for r in rows), sum(r.total for r in rows)
        differ = sum(not r.identical for r in rows)
        stock = _mean(r.stock_tps for r in rows)
        mine = _mean(r.moeflux_tps for r in rows)
        table.append(
            [
                "all",
                f"{same}/{total}",
                "-" if not differ else f"{differ} of {len(rows)} prompts",
                _dlp(report.max_dlogprob),
                _dlp(report.max_kl),
                _num(stock),
                _num(mine),
                _num(mine / stock if stock else float("nan"), ".2f"),
            ]
        )
    widths = [max(len(row[i]) for row in [header] + table) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(table) > len(rows):
        lines.insert(len(lines) - 1, lines[1])
    s = report.expert_stats
    if s:
        summary = expert_summary({"total": s, "io_mode": s["io_mode"]})
        lines.append(f"moeflux expert I/O: {summary}; backend {report.backend}")
    for r in rows:
        if r.reply:
            lines.append(f"moeflux's reply to {_short(r.prompt)!r}: {_short(r.reply, 72)!r}")
    if report.tolerance == 0 and report.kl_tolerance is None:
        tol = f"exact ({report.device.upper()})"
    else:
        parts = ["tokens identical"]
        if report.kl_tolerance is not None:
            parts.append(f"KL per step <= {report.kl_tolerance:g} nats")
        if report.tolerance is not None:
            parts.append(f"|Δ log-prob| <= {report.tolerance:g}")
        tol = ", ".join(parts) + f" ({report.device})"
    if not report.stock_ran:
        lines.append("Result: NOT COMPARED (stock mlx-lm did not run)")
    elif report.passed:
        lines.append(f"Result: SAME (required: {tol})")
    else:
        lines.append(f"Result: DIFFERENT (required: {tol})")
    return "\n".join(lines)


def _mean(values) -> float:
    v = [x for x in values if x is not None and not math.isnan(x)]
    return sum(v) / len(v) if v else float("nan")


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model_path)
    converted = None if args.converted is None else resolve_model(args.converted)
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    n = f"{len(prompts)} prompt" + "s" * (len(prompts) > 1)
    say(
        f"Comparing stock mlx-lm with moeflux-mlx: {n}, greedy, at most {args.max_tokens} tokens "
        f"each, device {device_name()}"
    )
    report = compare(
        path,
        prompts,
        max_tokens=args.max_tokens,
        moeflux_path=converted,
        load_options=load_kwargs(args),
        force=args.force,
        tolerance=args.logprob_tol,
        kl_tolerance=args.kl_tol,
        use_chat_template=not args.ignore_chat_template,
    )
    print(format_report(report))
    if not report.stock_ran:
        return EXIT_NOT_COMPARED
    return EXIT_SAME if report.passed else EXIT_DIFFERENT


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_path",
        metavar="MODEL",
        nargs="?",
        default=None,
        help="an mlx-lm MoE checkpoint (default: the built-in demo model)",
    )
    parser.add_argument(
        "--prompt",
        "-p",
        action="append",
        default=None,
        help="a prompt to compare on (repeatable; default: "
        f"{len(DEFAULT_PROMPTS)} built-in prompts)",
    )
    parser.add_argument(
        "--max-tokens",
        "-m",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        help=f"tokens to generate per prompt (default: {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--converted",
        metavar="DIR",
        default=None,
        help="run moeflux-mlx on this converted directory of MODEL instead of on MODEL itself",
    )
    parser.add_argument(
        "--logprob-tol",
        type=float_in(0.0),
        default=None,
        help="largest |Δ log-prob| accepted (default: 0 on the CPU, not checked on a GPU); "
        "tokens must be identical either way",
    )
    parser.add_argument(
        "--kl-tol",
        type=float_in(0.0),
        default=None,
        help="largest KL divergence of a step's distribution from stock's, in nats (default: "
        f"{GPU_KL_TOL} on a GPU, not checked on the CPU, where every log-prob must be equal)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="run stock mlx-lm even when the model does not fit in memory",
    )
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompts without the tokenizer's chat template",
    )
    add_load_args(parser)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("compare", DESCRIPTION, add_args), run, argv)
