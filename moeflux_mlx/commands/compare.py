"""``moeflux-mlx compare``: is the streaming model the same model as stock mlx-lm's, and how fast?

Loads the checkpoint with ``mlx_lm.load`` and runs a few prompts greedily, frees it; loads it
again with its floating parameters in float32 (the reference) and scores stock's tokens; loads
it with ``moeflux_mlx.load`` and runs the same prompt tokens greedily, then scores stock's tokens
too where its own differ. Scoring is teacher-forced: every model sees stock's greedy tokens as
its context, so that each position's distribution is comparable even after a near tie sent the
two greedy runs apart.

On the CPU backend the two must agree exactly (identical tokens, every log-prob equal): the
plain-ops path is bit-identical with stock there. On a GPU the fused kernels round bf16 sums in
another order than stock's ``gather_qmm``, so tokens may part at a near tie with nothing wrong;
the rule there is the float32 one: over every scored position of every prompt, moeflux's mean
KL divergence from the float32 reference may be at most ``FLOAT32_FACTOR`` times stock's own
plus ``FLOAT32_FLOOR`` (``passes_float32_rule``). Exit status: 0 same, 1 different, 2 error, 3
not compared (stock mlx-lm was not run: the model does not fit in memory, ``--force``; or stock
or the reference gave no finite log-probs to judge by).
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
from ..format.safetensors import index_directory
from ..io.store import open_store
from ..model.load import load
from ..options import LoadOptions
from .common import (
    add_load_args,
    command_parser,
    device_name,
    expert_summary,
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
# The float32 rule (a GPU): moeflux's mean KL(float32 || moeflux) per scored token may be at most
# FLOAT32_FACTOR x stock's own mean KL(float32 || stock) + FLOAT32_FLOOR. Measured on the trained
# demo (3 built-in prompts, 32 tokens, 69 positions), as the ratio of the two means: rounding
# alone gives 0.91 (experts computed in float32, then rounded to bf16; CPU), 1.05 (each expert
# output moved by +-1 bf16 ulp at random; CPU), 1.13 (the fused CUDA kernels, H100) and 1.09
# (the fused kernels, H200; docs/results.md, "Correctness"). Errors give 1.54 (every expert's
# output scaled by 1.10; CPU), 1.48 (layer 0 of eight with each token's first expert computed as
# its second; CPU), 2.27 and 3.08 (that in every layer; CPU, H200), 4.5 and 5.23 (a 1.25 scale;
# CPU, H200). 1.3 leaves rounding 15% of headroom above its largest (1.13) and fails those
# errors. It cannot fail every error: the same wrong expert in layers 1-7 gives 0.89-1.25 on the
# CPU, where such an error moves the demo's output less than bf16 rounding does; 1.2 would catch
# one more layer (1.25) with 6% of headroom over the H100's rounding. The bound is on the mean
# over every position, the statistic with the least noise: per prompt rounding alone spread from
# 0.76 to 1.27 (CPU; 0.97 to 1.26 on the H200) over 11-32 positions, and a short --prompt spreads
# wider. A per-prompt bound of 1.5 would add layers 1 and 3 (worst prompts 2.26, 1.52) with 18%
# of headroom over rounding's worst prompt, less on fewer positions; and no rule per position:
# there a rounding-only variant was 145-448x stock's distance (both near 0). Stock's bf16 lies
# about 1.8x farther from float32 on the CPU than on the H200 (1.42e-2 against 8.09e-3 nats a
# token), and an error adds about the same KL on both (a wrong expert in every layer: +1.8e-2 on
# the CPU, +1.7e-2 on the H200), so its ratio is larger on a GPU: the CPU's figures are the hard
# case. The floor keeps a float32 checkpoint (stock is its own reference: 0) judgeable: float32
# rounding moves KL by far less, a wrong expert by far more.
FLOAT32_FACTOR = 1.3
FLOAT32_FLOOR = 1e-5
DESCRIPTION = (
    "run the same prompts greedily with stock mlx-lm and with moeflux-mlx; compare tokens, "
    "log-probs and speed (on the CPU they must be identical; on a GPU moeflux must lie as close "
    "to a float32 reference as stock does)"
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
    stock_tps: float
    moeflux_tps: float
    reply: str = ""  # moeflux's text, so a person can judge it too
    # KL(float32 || model) in nats at each position of stock's tokens (teacher-forced)
    stock_kl: np.ndarray = field(default_factory=lambda: np.zeros(0))
    moeflux_kl: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def identical(self) -> bool:
        return self.first_divergence is None


@dataclass
class Report:
    model: Path
    moeflux_model: Path
    rows: List[Row]
    stock_ran: bool
    exact: bool  # the rule: exact (CPU) or the float32 one (GPU)
    device: str
    backend: str = ""
    expert_stats: dict = field(default_factory=dict)

    @property
    def max_dlogprob(self) -> float:
        return max((r.max_dlogprob for r in self.rows), default=0.0)

    def kl(self, side: str) -> np.ndarray:
        """``side``'s (``"stock"`` or ``"moeflux"``) KL from float32 at every position judged:
        those where stock's is finite (stock or the reference may give NaN, which says nothing
        of moeflux)."""
        stock = np.concatenate([np.zeros(0)] + [r.stock_kl for r in self.rows])
        mine = np.concatenate([np.zeros(0)] + [getattr(r, f"{side}_kl") for r in self.rows])
        return mine[np.isfinite(stock)]

    @property
    def judged(self) -> bool:
        """Whether there is anything to judge by: stock ran, and under the float32 rule stock
        and the reference gave finite log-probs somewhere."""
        return self.stock_ran and (self.exact or self.kl("stock").size > 0)

    @property
    def passed(self) -> bool:
        if not self.judged:
            return False
        if self.exact:
            return all(r.identical for r in self.rows) and self.max_dlogprob == 0
        return passes_float32_rule(self.kl("stock"), self.kl("moeflux"))


def passes_float32_rule(stock_kl: np.ndarray, moeflux_kl: np.ndarray) -> bool:
    """The rule on a GPU: moeflux as close to the float32 reference as stock is.

    Args:
        stock_kl: KL(float32 || stock) in nats at each position judged.
        moeflux_kl: KL(float32 || moeflux) at the same positions.

    Returns:
        Whether moeflux's mean is at most ``FLOAT32_FACTOR`` x stock's + ``FLOAT32_FLOOR``
        (false when moeflux's is NaN or infinite anywhere).
    """
    if not np.isfinite(moeflux_kl).all():
        return False
    return float(moeflux_kl.mean()) <= FLOAT32_FACTOR * float(stock_kl.mean()) + FLOAT32_FLOOR


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


def forced(model, prompt: Sequence[int], continuation: Sequence[int]) -> List[np.ndarray]:
    """The log-probs ``model`` gives each token of ``continuation`` after ``prompt``: the steps
    ``greedy`` takes (the same prefill and one-token decode calls), with ``continuation``'s
    tokens fed in place of its own choices. Where those are its own, this is ``greedy``'s
    log-probs bit for bit.

    Args:
        model: an mlx-lm model (stock, the float32 reference or moeflux's).
        prompt: the prompt tokens.
        continuation: the tokens to score, in order.

    Returns:
        One float32 log-prob vector per token of ``continuation``.
    """
    if not continuation:
        return []
    fed = iter(continuation)

    def sampler(logprobs: mx.array) -> mx.array:
        # generate_step asks for one token more than it yields
        return mx.array([next(fed, 0)], dtype=mx.uint32)

    steps = generate_step(
        mx.array(list(prompt)), model, max_tokens=len(continuation), sampler=sampler
    )
    return [np.array(lp.astype(mx.float32)) for _, lp in steps]


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


def kl_per_position(ref: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> np.ndarray:
    return np.array([kl_divergence(r, g) for r, g in zip(ref, got)], dtype=np.float64)


def compare_runs(
    prompt: str,
    ref: GreedyRun,
    got: GreedyRun,
    reference: Optional[Sequence[np.ndarray]] = None,
    got_forced: Optional[Sequence[np.ndarray]] = None,
) -> Row:
    """Stock's greedy run ``ref`` against moeflux's ``got``; with ``reference`` (the float32
    log-probs of ``ref.tokens``) and ``got_forced`` (moeflux's on them; default: ``got``'s,
    which are the same when its tokens are) also each one's KL from float32."""
    n = min(len(ref.tokens), len(got.tokens))
    div = next((i for i in range(n) if ref.tokens[i] != got.tokens[i]), None)
    if div is None and len(ref.tokens) != len(got.tokens):
        div = n
    # Up to the divergence both models saw the same context, so their log-probs are comparable.
    steps = n if div is None else min(div + 1, n)
    dlp = max((max_abs_diff(ref.logprobs[i], got.logprobs[i]) for i in range(steps)), default=0.0)
    row = Row(
        prompt,
        n if div is None else div,
        max(len(ref.tokens), len(got.tokens)),
        div,
        dlp,
        ref.tps,
        got.tps,
    )
    if reference is not None:
        row.stock_kl = kl_per_position(reference, ref.logprobs)
        row.moeflux_kl = kl_per_position(
            reference, got.logprobs if got_forced is None else got_forced
        )
    return row


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def reference_bytes(path: Path) -> int:
    """What the float32 reference holds: the checkpoint's bytes, its 16-bit floating tensors
    (scales, biases, norms, unquantized weights) twice over; quantized weights stay packed."""
    return sum(
        t.nbytes * (2 if t.dtype in ("BF16", "F16") else 1)
        for t in index_directory(Path(path)).values()
    )


def load_reference(path: Path):
    """Stock mlx-lm's model of ``path`` with its floating parameters in float32.

    ``set_dtype`` casts every floating parameter (the quantized weights' scales and biases
    too; the packed weights are integers and stay), so activations, matmuls and logits are
    float32. Loaded lazily and cast before anything is read, so that the 16-bit weights are
    never resident beside their float32 copies.

    Args:
        path: an mlx-lm checkpoint.

    Returns:
        The model.
    """
    model = mlx_lm.load(str(path), lazy=True)[0]
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


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
    exact: Optional[bool] = None,
    use_chat_template: bool = True,
) -> Report:
    """Run ``prompts`` greedily on stock mlx-lm and on moeflux-mlx, score stock's tokens with
    the float32 reference (and with moeflux where its tokens differ); return the comparison.

    Args:
        model_path: the mlx-lm checkpoint stock mlx-lm loads.
        prompts: the prompts, each run greedily on both.
        max_tokens: tokens to generate per prompt.
        moeflux_path: what moeflux-mlx loads instead of ``model_path`` (a converted copy).
        load_options: ``moeflux_mlx.load`` keyword arguments.
        force: run stock mlx-lm and the reference even when the reference's weights do not
            fit in the memory available.
        exact: judge by exact equality (default: on the CPU) rather than by the float32 rule
            (default: on a GPU; ``passes_float32_rule``).
        use_chat_template: render the prompts with the tokenizer's chat template.

    Returns:
        The report (``passed``: the rule met).

    Raises:
        CheckpointError: a model is not a usable MoE checkpoint (``check_models``).
    """
    model_path = Path(model_path)
    moeflux_path = Path(moeflux_path) if moeflux_path is not None else model_path
    check_models(model_path, moeflux_path, load_options)
    if exact is None:
        exact = mx.default_device() == mx.cpu
    report = Report(model_path, moeflux_path, [], False, exact, device_name())

    # The reference is the largest of the three models (loaded one at a time): 16-bit floating
    # tensors doubled. A bf16 checkpoint 4-bit quantized with group 64 holds about 1.1x stock's
    # bytes, an unquantized one 2x.
    need, avail = reference_bytes(model_path), available_memory()
    fits = need <= STOCK_MEMORY_FRACTION * avail
    stock_runs = tokens = reference = None
    if fits or force:
        if not fits:
            say(
                f"--force: running stock mlx-lm and the float32 reference although the "
                f"reference's {fmt_bytes(need)} of weights exceed {STOCK_MEMORY_FRACTION:.0%} "
                f"of the {fmt_bytes(avail)} available"
            )
        size = fmt_bytes(checkpoint_bytes(model_path))
        say(f"stock mlx-lm: loading {model_path} ({size} of weights) ...")
        model, tokenizer = mlx_lm.load(str(model_path))[:2]  # no config: not asked for it
        tokens = [prompt_tokens(tokenizer, p, use_chat_template=use_chat_template) for p in prompts]
        eos = set(tokenizer.eos_token_ids)
        stock_runs = _run_all(model, tokens, max_tokens, eos, "stock mlx-lm")
        del model, tokenizer  # stock weights out of memory before the next model loads
        _release_memory()
        say(f"float32 reference: loading {model_path} ({fmt_bytes(need)} in float32) ...")
        model = load_reference(model_path)
        reference = _score_all(model, tokens, stock_runs, "float32 reference")
        del model
        _release_memory()
        report.stock_ran = True
    else:
        say(
            f"Stock mlx-lm's float32 reference would read {fmt_bytes(need)} of weights into "
            f"memory, but only {fmt_bytes(avail)} is available: not running it (it would "
            "thrash; --force tries anyway). Running moeflux-mlx alone."
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
        scored: List[Optional[List[np.ndarray]]] = [None] * len(runs)
        if stock_runs is not None:
            # where its own tokens are stock's, its greedy log-probs are the scores already
            differ = [i for i, (a, b) in enumerate(zip(stock_runs, runs)) if a.tokens != b.tokens]
            for i in differ:
                say(f"moeflux-mlx: scoring stock's tokens for prompt {i + 1}/{len(prompts)} ...")
                scored[i] = forced(model, tokens[i], stock_runs[i].tokens)
    finally:
        model.moeflux.close()
    if stock_runs is None or reference is None:
        report.rows = [
            Row(p, 0, len(r.tokens), None, 0.0, float("nan"), r.tps) for p, r in zip(prompts, runs)
        ]
    else:
        report.rows = [
            compare_runs(p, a, b, ref, got)
            for p, a, b, ref, got in zip(prompts, stock_runs, runs, reference, scored)
        ]
    for row, run in zip(report.rows, runs):
        row.reply = tokenizer.decode([t for t in run.tokens if t not in eos])
    return report


def _score_all(model, prompts: List[List[int]], runs: List[GreedyRun], side: str):
    """``forced`` for each prompt and stock's tokens, with a status line per prompt."""
    out = []
    for i, (p, r) in enumerate(zip(prompts, runs), 1):
        say(f"{side}: scoring stock's tokens for prompt {i}/{len(prompts)} ...")
        out.append(forced(model, p, r.tokens))
    return out


def _short(text: str, width: int = 32) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _num(x: Optional[float], fmt: str = ".1f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def _dlp(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def _kl(values: np.ndarray) -> str:
    """``mean / max`` of KL values, ``-`` for none."""
    if values.size == 0:
        return "-"
    return f"{_dlp(float(values.mean()))} / {_dlp(float(values.max()))}"


def format_report(report: Report) -> str:
    """The comparison as a table, a row per prompt and one for all, then the verdict.

    Args:
        report: what ``compare`` returned.

    Returns:
        The text, lines joined by newlines (no trailing one).
    """
    rows = report.rows
    header = [
        "prompt",
        "tokens identical",
        "first divergence",
        "max |Δ log-prob|",
        "mlx-lm KL to f32",
        "moeflux KL to f32",
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
                    _kl(r.stock_kl),
                    _kl(r.moeflux_kl),
                    _num(r.stock_tps),
                    _num(r.moeflux_tps),
                    _num(ratio, ".2f"),
                ]
            )
        else:
            table.append([_short(r.prompt), "-", "-", "-", "-", "-", "-", _num(r.moeflux_tps), "-"])
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
                _kl(report.kl("stock")),
                _kl(report.kl("moeflux")),
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
    if report.stock_ran:
        lines.append(
            "KL to f32: KL(float32 || model) in nats, mean / max over the positions of stock's "
            "tokens, every model fed them"
        )
    s = report.expert_stats
    if s:
        summary = expert_summary({"total": s, "io_mode": s["io_mode"]})
        lines.append(f"moeflux expert I/O: {summary}; backend {report.backend}")
    for r in rows:
        if r.reply:
            lines.append(f"moeflux's reply to {_short(r.prompt)!r}: {_short(r.reply, 72)!r}")
    if report.exact:
        rule = f"exact ({report.device.upper()})"
    else:
        rule = (
            f"moeflux's mean KL to f32 <= {FLOAT32_FACTOR:g} x mlx-lm's + {FLOAT32_FLOOR:g}"
            f" nats ({report.device})"
        )
        if report.judged:
            mine, stock = report.kl("moeflux").mean(), report.kl("stock").mean()
            bound = FLOAT32_FACTOR * stock + FLOAT32_FLOOR
            rule = f"{rule}; here {_dlp(float(mine))} against {_dlp(float(bound))}"
    if not report.stock_ran:
        lines.append("Result: NOT COMPARED (stock mlx-lm did not run)")
    elif not report.judged:
        lines.append(
            "Result: NOT COMPARED (stock mlx-lm or the float32 reference gave no finite "
            "log-probs to judge by)"
        )
    elif report.passed:
        lines.append(f"Result: SAME (required: {rule})")
    else:
        lines.append(f"Result: DIFFERENT (required: {rule})")
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
        use_chat_template=not args.ignore_chat_template,
    )
    print(format_report(report))
    if not report.judged:
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
        "--force",
        action="store_true",
        help="run stock mlx-lm and its float32 reference even when they do not fit in memory",
    )
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompts without the tokenizer's chat template",
    )
    add_load_args(parser)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("compare", DESCRIPTION, add_args), run, argv)
