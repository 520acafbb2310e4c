"""A model's hit-rate curve, and the cache budget ``"auto"`` chosen from it.

The curve: the share of routed expert bytes the cache serves from its slots (the hit rate), at
budgets of 0, 5, ..., 100% of the experts. It comes from a routing trace (every MoE layer's
experts, token after token, recorded by ``model.calibrate`` on a short text) replayed through
the real eviction policy (``cache.policy.POLICIES``) at each budget, split over the layers as
the cache splits it (``slots.slots_per_layer``). Uniform routing's ``n / E`` has no knee; a
trained router's skew and reuse do.

Who writes what, and when: ``moeflux-mlx doctor MODEL`` (or ``benchmarks/forecast.py``) records
the curve, with the decode terms it measured beside it (``Timing``), in
``moeflux-hit-curve.json`` in the model directory, or where that is not writable in the user
cache (``$XDG_CACHE_HOME/moeflux-mlx/curves``). Each write replaces the whole file atomically
(a temporary file, then ``os.replace``): a reader sees the old file or the new one, never half
of one. Loads only read it.

``"auto"`` (``auto_budget``, which loads reach through ``resolve_budget`` and ``doctor`` calls
itself): at most what the default (None) gives. Where every expert fits in that, every expert.
Else, on the curve, with ``t(b) = t_stream + (1 - h(b)) x expert bytes per token / miss rate``,
the smallest budget whose forecast rate is ``AUTO_RATE_SHARE`` of the rate at the most it may take.
Without a usable curve file: the default, and one log line saying how to record one (calibrating at
load would read every expert once: minutes on a large model).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Type

import numpy as np

from ..errors import CurveError
from ..format.layout import ModelLayout
from ..options import DEFAULT_RAM_FRACTION, Budget, is_auto, parse_budget, user_cache_dir
from .policy import EvictionPolicy
from .slots import slots_per_layer

log = logging.getLogger(__name__)

CURVE_FILE = "moeflux-hit-curve.json"
FORMAT = 1
# the budgets the curve is simulated at, as shares of the experts' bytes: a 5% grid is finer
# than a user picks budgets by, and 19 replays of a short trace take seconds
SHARES = tuple(i / 20 for i in range(21))
# hits are counted over the trace's later half only: the first half fills the slots, as the
# turns before it fill a running model's (the cache starts empty; decode runs long after)
WARMUP_SHARE = 0.5
# auto takes the smallest budget forecast to decode at this share of the rate at the most it may
# take: 5% is about what repeated decode timings spread by, so a larger budget would buy a gain
# hard to tell from noise while keeping memory from the page cache and everything else
AUTO_RATE_SHARE = 0.95
HINT = "run `moeflux-mlx doctor MODEL` once to record the model's hit-rate curve"


@dataclass(frozen=True)
class Timing:
    """What the forecast needs besides the curve, as ``doctor`` measured it: the line
    ``t = compute_s_per_token + missed bytes / bandwidth`` through decode measured at two
    budgets (``commands.doctor.calibrate_decode``).

    Attributes:
        bandwidth: bytes/s: what a missed byte costs decode (its read, its copy, the device's
            wait for it); where the two decodes gave no line, the disk's read rate.
        compute_s_per_token: decode seconds per token on the streaming path with nothing missed.
        basis: where ``bandwidth`` comes from (``misses measured in decode``, ``warm`` or
            ``cold`` reads), for people.
    """

    bandwidth: float
    compute_s_per_token: float
    basis: str = "warm"


@dataclass(frozen=True)
class HitCurve:
    """Hit rate by budget share, per eviction policy, for one model.

    Attributes:
        shares: budget shares of the experts' bytes, ascending, 0 to 1.
        hit_rates: policy name -> hit rate at each share (non-decreasing, 1.0 at share 1).
        num_experts: experts of each MoE layer, in layer order (what the curve is valid for).
        top_k: experts a token routes.
        total_expert_bytes: the model's expert bytes.
        tokens: trace tokens it was simulated over.
        timing: the measured bandwidth and compute time (None: not measured).
        path: the file it was read from or written to (None: not stored).
    """

    shares: Sequence[float]
    hit_rates: Mapping[str, Sequence[float]]
    num_experts: Sequence[int]
    top_k: int
    total_expert_bytes: int
    tokens: int
    timing: Optional[Timing] = None
    path: Optional[Path] = field(default=None, compare=False)

    def hit_rate(self, policy: str, share: float) -> float:
        """The hit rate at ``share`` (0..1) of the experts, linear between the grid's points.

        Args:
            policy: an eviction policy name with a curve here.
            share: the budget as a share of the experts' bytes (clipped to 0..1).

        Returns:
            The hit rate, 0..1.

        Raises:
            KeyError: no curve for ``policy``.
        """
        return float(np.interp(min(max(share, 0.0), 1.0), self.shares, self.hit_rates[policy]))

    def fits(self, layout: ModelLayout, top_k: Optional[int] = None) -> bool:
        """Whether the curve was recorded for a model of this layout (and top-k)."""
        return (
            list(self.num_experts) == [lay.num_experts for _, lay in sorted(layout.layers.items())]
            and self.total_expert_bytes == layout.total_expert_bytes
            and (top_k is None or top_k == self.top_k)
        )

    def same_model(self, other: HitCurve) -> bool:
        """Whether ``other`` was recorded for the same model as this curve (experts per layer,
        top-k, expert bytes): ``fits`` without a layout at hand."""
        return (
            list(self.num_experts) == list(other.num_experts)
            and self.top_k == other.top_k
            and self.total_expert_bytes == other.total_expert_bytes
        )

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "shares": list(self.shares),
            "hit_rates": {k: list(v) for k, v in self.hit_rates.items()},
            "num_experts": list(self.num_experts),
            "top_k": self.top_k,
            "total_expert_bytes": self.total_expert_bytes,
            "tokens": self.tokens,
            "timing": None if self.timing is None else vars(self.timing),
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }


# --------------------------------------------------------------------------- simulation


def layer_hits(
    rows: np.ndarray, num_experts: int, n_slots: int, policy: Type[EvictionPolicy]
) -> float:
    """The hit rate of one layer's trace through ``n_slots`` slots, driven as the cache's book
    drives its policy (one call per token, ``admit`` then ``assign``), counted after
    ``WARMUP_SHARE`` of the rows.

    Args:
        rows: ``[tokens, k]`` routed experts.
        num_experts: the layer's experts.
        n_slots: its slots at the budget.
        policy: the eviction policy's class.

    Returns:
        Hits over routed experts (0..1). A layer with every expert resident hits every time
        (it is filled once, whole); one with fewer slots than a token routes serves every call
        from staging (no hits).
    """
    if n_slots >= num_experts:
        return 1.0
    start = int(len(rows) * WARMUP_SHARE)
    p = policy(num_experts, n_slots)
    hits = routed = 0
    for tick, row in enumerate(rows, start=1):
        experts = np.unique(row)
        if experts.size > n_slots:
            return 0.0  # every call of the trace routes top-k: none is ever served by slots
        missing, victims = p.admit(experts, tick)
        p.assign(missing, victims, tick)
        if tick > start:
            hits += experts.size - missing.size
            routed += experts.size
    return hits / routed if routed else 0.0


def simulate(
    layout: ModelLayout,
    routing: Mapping[int, np.ndarray],
    policy: Type[EvictionPolicy],
    shares: Sequence[float] = SHARES,
) -> List[float]:
    """The hit rate at each budget share: each layer's trace replayed through the slots the
    cache gives it at that budget, weighted by the layer's expert bytes.

    A larger budget keeps a superset of slots in every layer, but a policy other than LRU is
    not a stack algorithm, so a short trace can hit a little less at a larger budget; the curve
    takes the running maximum (more memory never makes decode slower in the forecast).

    Args:
        layout: the model's expert layout.
        routing: layer -> ``[tokens, k]`` routed experts (every MoE layer of ``layout``).
        policy: the eviction policy's class.
        shares: ascending budget shares, 0..1.

    Returns:
        Hit rates, one per share, non-decreasing, 1.0 at share 1.
    """
    total = layout.total_expert_bytes
    weight = {i: lay.blob_size for i, lay in layout.layers.items()}
    out: List[float] = []
    for share in shares:
        if share >= 1:
            out.append(1.0)  # "all": every layer holds every expert
            continue
        n = slots_per_layer(layout, int(share * total))
        h = sum(
            weight[i] * layer_hits(routing[i], lay.num_experts, n[i], policy)
            for i, lay in layout.layers.items()
        ) / max(sum(weight.values()), 1)
        out.append(max(h, out[-1] if out else 0.0))
    return out


# --------------------------------------------------------------------------- files


def curve_paths(model_dir: Path) -> List[Path]:
    """Where a model's curve may be, in the order read: its directory, then the user cache
    (a file named by the directory's resolved path)."""
    model_dir = Path(model_dir).expanduser().resolve()
    digest = hashlib.sha1(str(model_dir).encode()).hexdigest()[:16]
    return [model_dir / CURVE_FILE, user_cache_dir() / "curves" / f"{model_dir.name}-{digest}.json"]


def read_curve(path: Path) -> HitCurve:
    """The curve in ``path``.

    Args:
        path: a file ``write_curve`` wrote.

    Returns:
        The curve (``path`` set).

    Raises:
        CurveError: unreadable, not JSON, another format, or values out of range.
    """
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CurveError(f"{path}: not a readable hit-rate curve ({e}); {HINT}") from None
    try:
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}, expected {FORMAT}")
        shares = [float(s) for s in d["shares"]]
        rates = {str(k): [float(h) for h in v] for k, v in d["hit_rates"].items()}
        if shares != sorted(shares) or shares[0] != 0 or shares[-1] != 1:
            raise ValueError("shares must rise from 0 to 1")
        for name, h in rates.items():
            if len(h) != len(shares) or not all(0 <= x <= 1 for x in h) or h[-1] != 1:
                raise ValueError(f"the {name} curve is not a hit rate at each share")
        t = d.get("timing")
        timing = (
            None
            if t is None
            else Timing(float(t["bandwidth"]), float(t["compute_s_per_token"]), str(t["basis"]))
        )
        return HitCurve(
            shares,
            rates,
            [int(e) for e in d["num_experts"]],
            int(d["top_k"]),
            int(d["total_expert_bytes"]),
            int(d["tokens"]),
            timing,
            Path(path),
        )
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CurveError(f"{path}: not a hit-rate curve ({e}); {HINT}") from None


def find_curve(model_dir: Path) -> Optional[HitCurve]:
    """The model's recorded curve, or None where none is recorded.

    Where both places hold one (the model directory was not writable when a newer curve was
    recorded, so it went to the user cache and the older one could not be removed), the newer
    file wins: loads then read the curve ``doctor`` last recorded and printed.

    Args:
        model_dir: the model directory.

    Returns:
        The most recently modified of ``curve_paths`` that reads as a curve; None if none
        exists.

    Raises:
        CurveError: files exist, but none is a curve (the newest one's error).
    """
    found = []
    for order, path in enumerate(curve_paths(model_dir)):
        try:
            found.append((path.stat().st_mtime_ns, -order, path))
        except OSError:
            continue  # not there (or not to be seen): no curve in this place
    first_error: Optional[CurveError] = None
    # newest first; at equal times the model directory's, as before there were two places
    for _, _, path in sorted(found, reverse=True):
        if not path.is_file():
            continue
        try:
            curve = read_curve(path)
        except CurveError as e:  # a damaged newer file must not hide an older good one
            first_error = first_error or e
            continue
        if first_error is not None:
            log.warning("%s; reading the older %s", first_error, path)
        return curve
    if first_error is not None:
        raise first_error
    return None


def _replace_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` by way of a temporary file beside it and ``os.replace``: a
    reader sees the old file or the new one, never half of one.

    The temporary file is created with mode 0o644 and the umask applied, as ``open`` would
    create ``path`` itself (``mkstemp``'s 0600 would survive the replace, and other users of a
    shared model directory could not read the curve: their ``auto`` would fall back). Its bytes
    are synced before the rename, so a crash cannot leave an empty file under the name.

    Args:
        path: the file to replace.
        text: its new contents.

    Raises:
        OSError: the directory cannot be written (the temporary file is removed).
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_curve(model_dir: Path, curve: HitCurve) -> Path:
    """Record ``curve`` for the model in ``model_dir``: in the directory if it is writable,
    else in the user cache; atomically (never half a file), merged with the curves of other
    policies already recorded for the same model (a curve recorded for another model, such as
    an earlier conversion in the same directory, is dropped).

    Args:
        model_dir: the model directory.
        curve: the curve (its ``path`` is ignored).

    Returns:
        The file written.

    Raises:
        OSError: neither place could be written.
    """
    rates = dict(curve.hit_rates)
    try:
        old = find_curve(model_dir)
    except CurveError:
        old = None  # replaced whole
    # list(): a curve read back holds lists, one built in memory may hold SHARES, a tuple
    if old is not None and list(old.shares) == list(curve.shares) and old.same_model(curve):
        rates = {**old.hit_rates, **rates}
        if curve.timing is None and old.timing is not None:
            curve = HitCurve(**{**vars(curve), "timing": old.timing})
    text = json.dumps({**curve.to_json(), "hit_rates": rates}, indent=1)
    error: Optional[OSError] = None
    for path in curve_paths(model_dir):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _replace_atomically(path, text)
        except OSError as e:
            error = e
            continue
        # a stale copy in the other place would outlive this one; where it cannot be removed
        # (a model directory not writable), find_curve still reads this newer one
        for other in curve_paths(model_dir):
            if other != path and other.is_file():
                try:
                    other.unlink()
                except OSError:
                    pass
        return path
    assert error is not None
    raise error


# --------------------------------------------------------------------------- the pick


def tok_s(curve: HitCurve, policy: str, share: float, routed_bytes: float, timing: Timing) -> float:
    """Forecast decode tok/s at ``share`` of the experts: ``1 / (t_stream + (1 - h) x
    routed_bytes / bandwidth)``."""
    miss = (1 - curve.hit_rate(policy, share)) * routed_bytes
    s = timing.compute_s_per_token + (miss / timing.bandwidth if timing.bandwidth > 0 else 0)
    return 1 / s if s > 0 else float("inf")


@dataclass(frozen=True)
class BudgetChoice:
    """A cache budget in bytes and why.

    Attributes:
        bytes: the budget.
        why: how it was chosen, for the load log, ``info`` and ``doctor`` (one line).
        auto: whether ``"auto"`` chose it.
    """

    bytes: int
    why: str
    auto: bool = False


def pick(
    curve: HitCurve, policy: str, ceiling: int, routed_bytes: float, timing: Timing
) -> BudgetChoice:
    """The smallest budget on the curve's grid (or ``ceiling``) whose forecast rate is at least
    ``AUTO_RATE_SHARE`` of the rate at ``ceiling``.

    Args:
        curve: the model's curve, with a curve for ``policy``.
        policy: the eviction policy.
        ceiling: the most bytes auto may take (the default budget).
        routed_bytes: expert bytes a token routes.
        timing: bandwidth and compute time.

    Returns:
        The choice; its ``why`` names the forecast and the miss rate it assumes, and where that
        rate comes from (decode measured by doctor, or warm or cold reads: a curve recorded with
        the experts in the page cache forecasts faster misses than a machine whose page cache
        cannot hold them will see).
    """
    total = curve.total_expert_bytes
    top = min(1.0, ceiling / max(total, 1))
    best = tok_s(curve, policy, top, routed_bytes, timing)
    for share in [s for s in curve.shares if s < top] + [top]:
        rate = tok_s(curve, policy, share, routed_bytes, timing)
        if rate >= AUTO_RATE_SHARE * best:
            n = ceiling if share == top else int(share * total)
            why = (
                f"auto: {share:.0%} of the experts, forecast {rate:.1f} tok/s "
                f"(hit rate {curve.hit_rate(policy, share):.0%}, misses at "
                f"{timing.bandwidth / 1e9:.2f} GB/s: {timing.basis}), within {1 - AUTO_RATE_SHARE:.0%} of "
                f"{best:.1f} tok/s at the default {top:.0%} (curve {curve.path})"
            )
            return BudgetChoice(n, why, True)
    raise AssertionError("the ceiling itself qualifies")


def auto_budget(layout: ModelLayout, policy: str, curve: Optional[HitCurve]) -> BudgetChoice:
    """What ``"auto"`` chooses for a model with ``curve``: every expert where they fit in the
    default budget, else ``pick`` on the curve, else (no usable curve) the default with a
    warning. ``resolve_budget`` (loads, ``info``) and ``doctor`` both call it, so what doctor
    prints is what a load chooses.

    Args:
        layout: the model's expert layout (of this process's share, when sharded).
        policy: the eviction policy whose curve is read.
        curve: the model's curve (None: none recorded).

    Returns:
        The bytes and why.
    """
    total = layout.total_expert_bytes
    ceiling = parse_budget(None, total)
    if ceiling >= total:
        return BudgetChoice(
            ceiling, f"auto: every expert (they fit in {DEFAULT_RAM_FRACTION:g} x RAM)", True
        )
    why: Optional[str] = None
    if curve is None:
        why = f"no hit-rate curve recorded: {HINT}"
    elif not curve.fits(layout):
        why = f"{curve.path} was recorded for another model (or another share of it): {HINT}"
    elif policy not in curve.hit_rates:
        why = f"{curve.path} has no curve for eviction {policy}: {HINT} --eviction {policy}"
    elif curve.timing is None:
        why = f"{curve.path} has no measured bandwidth and decode time: {HINT}"
    else:
        routed = sum(curve.top_k * lay.blob_size for lay in layout.layers.values())
        return pick(curve, policy, ceiling, routed, curve.timing)
    return _default(ceiling, why)


def _default(ceiling: int, why: str) -> BudgetChoice:
    """auto's fallback, the default budget, with one warning saying why."""
    log.warning("cache budget auto: %s; using the default (%g x RAM)", why, DEFAULT_RAM_FRACTION)
    return BudgetChoice(ceiling, f"auto: the default, {DEFAULT_RAM_FRACTION:g} x RAM ({why})", True)


def resolve_budget(
    budget: Budget,
    layout: ModelLayout,
    model_dir: Optional[Path],
    policy: str,
) -> BudgetChoice:
    """A cache budget in bytes, ``"auto"`` included: the one place a budget becomes bytes
    for a model.

    Args:
        budget: any ``LoadOptions.cache_budget``.
        layout: the model's expert layout (of this process's share, when sharded).
        model_dir: where the curve is looked for (None: nowhere; auto is then the default).
        policy: the eviction policy (``LoadOptions.eviction``): the curve replayed through it.

    Returns:
        The bytes and why.

    Raises:
        OptionError: ``budget`` is not a budget (``parse_budget``).
    """
    total = layout.total_expert_bytes
    if not is_auto(budget):
        n = parse_budget(budget, total)
        return BudgetChoice(n, "default" if budget is None else f"given: {budget}")
    if parse_budget(None, total) >= total:
        return auto_budget(layout, policy, None)  # every expert: no curve to read
    try:
        curve = find_curve(model_dir) if model_dir is not None else None
    except CurveError as e:  # a bad file costs the pick, never the load
        return _default(parse_budget(None, total), str(e))
    return auto_budget(layout, policy, curve)
