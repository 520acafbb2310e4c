"""Every load option under one name, resolved once: ``LoadOptions``.

An option given as an argument wins over its ``MOEFLUX_*`` variable, which wins over the
default. This module is the only place that reads the environment for them, and it does so when
options are resolved (``LoadOptions.resolve``), never at import: a variable set after import
still counts. Values are read case-insensitively; a bad value (argument or variable) raises
``OptionError`` naming it, e.g. ``MOEFLUX_EXPERT_IO=banana: expected one of auto, mmap, pread, direct``.
Plain Python: the miss server process imports it without MLX.

    MOEFLUX_EXPERT_IO     expert_io     auto | mmap | pread | direct
    MOEFLUX_BACKEND       backend       auto | ops | metal | cuda
    MOEFLUX_EVICTION      eviction      transition | lru
    MOEFLUX_PIN_EXPERTS   pin_experts   auto (default) | 0/off | 1/on: CUDA: the GPU copies
                                        missed experts and a prefill's layers out of the
                                        page-locked expert files (auto: where they take at
                                        most half of RAM)

What the machine decides (read threads, whether the device-side table runs, how slots are
written, the miss server's timings, when a prefill reads whole layers) is not an option: it is
``Tuning``, chosen from the machine and reported by ``moeflux-mlx doctor`` and ``info``. Tests
and benchmarks may hand in another ``Tuning`` through ``LoadOptions.tuning``; no variable sets it.

Cache budgets (``parse_budget``): a size with a unit (``B``, SI ``kB`` ``MB`` ``GB`` ``TB``,
binary ``KiB`` ``MiB`` ``GiB`` ``TiB``), an ``int`` of bytes from Python, ``"all"``, ``0``, or a
share that names its base: ``"25% experts"`` (of the model's expert bytes) or ``"40% RAM"`` (of
physical RAM). A bare number such as ``0.25`` names no base and is refused. ``"auto"`` is a
budget too, but not one this module can turn into bytes: it is chosen from the model's recorded
hit-rate curve (``cache.curve.resolve_budget``, which reads files), never above the default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import psutil

from .errors import OptionError

IO_MODES = ("auto", "mmap", "pread", "direct")
BACKENDS = ("auto", "ops", "metal", "cuda")
SLOT_WRITES = ("host", "device")
EVICTIONS = ("transition", "lru")  # cache.policy.POLICIES
# of physical RAM: the cache budget when none is given and the experts do not fit in it
DEFAULT_RAM_FRACTION = 0.4

Budget = Union[None, int, str]

_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _switch(text: str) -> bool:
    word = str(text).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/moeflux-mlx`` (default ``~/.cache/moeflux-mlx``): what the package
    keeps between runs (kernel self-checks, hit-rate curves it cannot write beside a model) and
    the benchmarks' built models."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "moeflux-mlx"


def _auto_switch(text: str) -> Optional[bool]:
    """``_switch``, or None for ``auto`` (the machine decides)."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        return _switch(text)
    except ValueError:
        raise ValueError(f"expected auto or one of {', '.join(_TRUE + _FALSE)}") from None


class _Choice:
    """One of ``allowed``, case-insensitive; ``lenient``: a bad value passes through unchanged
    (lower-cased) when read leniently, for a consumer that judges it itself."""

    def __init__(self, allowed: Tuple[str, ...], lenient: bool = False):
        self.allowed, self.lenient = allowed, lenient

    def __call__(self, text: str) -> str:
        word = str(text).strip().lower()
        if word not in self.allowed:
            raise ValueError(f"expected one of {', '.join(self.allowed)}")
        return word


# option -> (variable, parser of its text: the value, or ValueError saying what it expects)
ENVIRONMENT: Dict[str, Tuple[str, Callable[[str], Any]]] = {
    # lenient: select_expert_io reads the variable itself and warns about a bad value
    "expert_io": ("MOEFLUX_EXPERT_IO", _Choice(IO_MODES, lenient=True)),
    "backend": ("MOEFLUX_BACKEND", _Choice(BACKENDS)),
    "eviction": ("MOEFLUX_EVICTION", _Choice(EVICTIONS)),
    "pin_experts": ("MOEFLUX_PIN_EXPERTS", _auto_switch),
}


def _check_budget(value) -> Budget:
    if not is_auto(value):
        parse_budget(value, 0)  # raises OptionError
    return value


def _check_tuning(value) -> Tuning:
    if not isinstance(value, Tuning):
        raise ValueError("expected a moeflux_mlx.options.Tuning")
    return value


# what an argument given to ``resolve`` must be: option -> checker returning the value to use
_ARGUMENTS: Dict[str, Callable[[Any], Any]] = {
    "expert_io": ENVIRONMENT["expert_io"][1],
    "backend": ENVIRONMENT["backend"][1],
    "eviction": ENVIRONMENT["eviction"][1],
    "pin_experts": _auto_switch,
    "cache_budget": _check_budget,
    "tuning": _check_tuning,
}


# parallel expert reads: the cores, from 8 to 16. A prefill's whole-layer reads from the page cache
# run faster on 16 threads than on 8 where the cores are there, and decode's few experts a layer
# read no slower
DEFAULT_THREADS = min(16, max(8, os.cpu_count() or 8))
# From the page cache, a call of a few experts (a decode step's misses) is bound by its calls,
# not its copying, and reads fastest on a few threads, while a cold disk serves it faster on
# every thread
DEFAULT_WARM_READ_THREADS = 4
# a call routing at least this many (token, expert) rows per expert of its layer names nearly
# every expert (1 - e^-4 = 98% at uniform routing): reading the whole layer costs few extra bytes
DEFAULT_PREFILL_WHOLE_LAYER = 4.0


@dataclass(frozen=True)
class Tuning:
    """What the machine decides, not the user: the defaults are the choices, made from the
    machine where a field is None (``decided``). ``doctor`` and ``info`` report them.

    Attributes:
        threads: parallel reads of the ``pread`` store (the cores, 8 to 16).
        warm_read_threads: a ``pread`` call of a few experts (at most 32 MiB) that the page
            cache holds is read on this many threads instead (0: always ``threads``).
        device_table: CUDA: decode looks slots up on the GPU (the device-side table); None:
            wherever it can run.
        slot_writes: ``host`` (into the pool's memory through a host view) or ``device``
            (through host staging and a GPU scatter); None: ``device`` on CUDA, else ``host``.
        wait_timeout_s: how long the GPU waits for the miss server before it gives up.
        server_poll_us, server_poll_max_us: the miss server's poll interval after a request,
            and the cap it grows to while no request comes.
        prefill_whole_layer: a call on a partly cached layer routing at least this many
            (token, expert) rows per expert (a prefill) reads its whole layer without a host
            sync; 0: never.
    """

    threads: int = DEFAULT_THREADS
    warm_read_threads: int = DEFAULT_WARM_READ_THREADS
    device_table: Optional[bool] = None
    slot_writes: Optional[str] = None
    wait_timeout_s: float = 60.0
    server_poll_us: float = 20.0
    server_poll_max_us: float = 1000.0
    prefill_whole_layer: float = DEFAULT_PREFILL_WHOLE_LAYER

    def __post_init__(self):
        if self.slot_writes not in (None,) + SLOT_WRITES:
            raise OptionError(f"slot_writes={self.slot_writes!r}: expected one of host, device")
        if self.threads < 1 or self.warm_read_threads < 0:
            raise OptionError("threads must be >= 1 and warm_read_threads >= 0")


@dataclass(frozen=True)
class LoadOptions:
    """How a model's experts are streamed: what ``moeflux_mlx.load`` and ``patch_model`` take.

    Attributes:
        cache_budget: MLX memory for resident experts: a size (``"8GB"``, ``"8GiB"``, an int of
            bytes), a share naming its base (``"25% experts"``, ``"40% RAM"``), ``"all"``, 0,
            or ``"auto"`` (the smallest budget, at most the default, whose forecast decode rate
            is near the default's, from the hit-rate curve ``moeflux-mlx doctor`` records;
            ``cache.curve``); None: every expert when they fit in 40% of RAM, else 40% of RAM.
        expert_io: ``auto`` (the RAM gate, ``io.store.choose_expert_io``: ``direct`` above 8 x
            RAM on Linux, ``pread`` above 0.75 x RAM, else ``mmap``), ``mmap``, ``pread``, or
            ``direct`` (``pread`` bypassing the page cache: faster cold reads, no reuse of what
            the cache held).
        backend: ``auto`` (Metal kernels on Metal, CUDA kernels on CUDA, MLX ops on the CPU),
            ``ops``, ``metal`` or ``cuda``.
        eviction: which resident expert a miss replaces (``cache.policy``): ``transition``
            (decayed use counts plus what tends to follow the call) or ``lru``.
        pin_experts: CUDA, device-side table: the expert files are mapped and page-locked in
            host RAM for the GPU (``cudaHostRegister``, read-only), and the GPU copies each
            missed expert, and a prefill's whole layers, straight out of them. The files stay
            in RAM while the model is loaded, so they must fit in 0.75 x RAM. None (auto): on
            where the files take at most ``PIN_RAM_SHARE`` of RAM and fit in the memory
            available.
        tuning: what the machine decides (``Tuning``); tests and benchmarks may set it.
    """

    cache_budget: Budget = None
    expert_io: str = "auto"
    backend: str = "auto"
    eviction: str = "transition"
    pin_experts: Optional[bool] = None
    tuning: Tuning = dataclasses.field(default_factory=Tuning)

    @classmethod
    def resolve(cls, **given) -> LoadOptions:
        """Options from the arguments ``given`` (None: not given), then the environment.

        Args:
            **given: any field of ``LoadOptions``.

        Returns:
            The resolved options (choices lower-cased).

        Raises:
            TypeError: an argument that is not a load option.
            OptionError: a bad value, given or in a ``MOEFLUX_*`` variable (the message names it).
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"unknown load option(s): {', '.join(unknown)}")
        # a variable is read (and must be valid) only for an option not given as an argument
        values = from_environment(strict=True, skip={k for k, v in given.items() if v is not None})
        for name, value in given.items():
            if value is None:
                continue
            check = _ARGUMENTS.get(name)
            if check is not None:
                try:
                    value = check(value)
                except OptionError:
                    raise
                except ValueError as e:
                    raise OptionError(f"{name}={value!r}: {e}") from None
            values[name] = value
        return cls(**values)

    def source(self, name: str, given: Optional[dict] = None) -> str:
        """Where option ``name`` came from, for messages: its flag, its variable or the default."""
        if given and given.get(name) is not None:
            return "--" + name.replace("_", "-")
        var = ENVIRONMENT.get(name, (None,))[0]
        if var and os.environ.get(var, "").strip():
            return f"{var}={os.environ[var]}"
        return "default"


def from_environment(strict: bool = False, skip: Iterable[str] = ()) -> dict:
    """The load options set by ``MOEFLUX_*`` variables (unset or empty ones left out).

    Args:
        strict: a bad value raises ``OptionError``; otherwise it is left out, except that a
            lenient choice (``MOEFLUX_EXPERT_IO``) passes through lower-cased for its consumer
            to judge (``select_expert_io`` warns and uses auto).
        skip: options not to read (given as arguments: their variables do not count).

    Returns:
        ``{option: value}``.

    Raises:
        OptionError: with ``strict``, e.g. ``MOEFLUX_EXPERT_IO=banana: expected one of auto,
            mmap, pread``.
    """
    out = {}
    skip = set(skip)
    for name, (var, parse) in ENVIRONMENT.items():
        if name in skip:
            continue
        text = os.environ.get(var)
        if text is None or not text.strip():
            continue
        try:
            out[name] = parse(text)
        except ValueError as e:
            if strict:
                raise OptionError(f"{var}={text}: {e}") from None
            if getattr(parse, "lenient", False):
                out[name] = text.strip().lower()
    return out


# --------------------------------------------------------------------------- cache budgets

SI_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
BINARY_UNITS = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_UNIT_NAMES = {"b": "B", "kb": "kB", "mb": "MB", "gb": "GB", "tb": "TB"}
_UNIT_NAMES.update({"kib": "KiB", "mib": "MiB", "gib": "GiB", "tib": "TiB"})
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.I)
_SHARE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*(?:of\s+)?(experts|ram)\s*$", re.I)
BUDGET_FORMS = (
    "a size with a unit (8GB, 512MiB), a share naming its base (25% experts, 40% RAM), all, 0, "
    "or auto"
)
AUTO = "auto"


def is_auto(budget: Budget) -> bool:
    """Whether ``budget`` is ``"auto"`` (any case, spaces around it ignored)."""
    return isinstance(budget, str) and budget.strip().lower() == AUTO


def _budget_error(budget, why: str) -> OptionError:
    return OptionError(f"cache budget {budget!r}: {why}")


def budget_unit(budget: Budget) -> Optional[str]:
    """The unit a budget was written in (``"GiB"``, ``"MB"``, ...), None for other forms: sizes
    are shown back in the units the user typed."""
    if isinstance(budget, str):
        m = _BUDGET.match(budget)
        if m and m[2]:
            return _UNIT_NAMES.get(m[2].lower())
    return None


def parse_budget(budget: Budget, total_expert_bytes: int) -> int:
    """Bytes of a cache budget.

    Args:
        budget: a size with a unit (``"8GB"`` = 8 x 1000^3 bytes, ``"8GiB"`` = 8 x 1024^3, also
            B, kB, MB, TB, KiB, MiB, TiB; case-insensitive); an ``int`` of bytes; a share
            naming its base, ``"25% experts"`` (of ``total_expert_bytes``) or ``"40% RAM"``
            (of physical RAM), at most 100%; ``"all"`` (every expert); ``0`` (none); or None:
            every expert when they fit in 40% of RAM, else 40% of RAM.
        total_expert_bytes: the model's expert bytes (for ``"all"``, ``"N% experts"``, None).

    Returns:
        The budget in bytes.

    Raises:
        OptionError (a ValueError): not a budget, e.g. ``0.25`` (a share of what? write
            ``25% experts`` or ``25% RAM``), ``8G`` (which G?), a negative number; or
            ``"auto"``, which only ``cache.curve.resolve_budget`` turns into bytes (it needs the
            model's curve).
    """
    if budget is None:
        return int(min(total_expert_bytes, DEFAULT_RAM_FRACTION * psutil.virtual_memory().total))
    if isinstance(budget, bool):
        raise _budget_error(budget, f"expected {BUDGET_FORMS}")
    if isinstance(budget, int):
        if budget < 0:
            raise _budget_error(budget, "is negative")
        return budget
    if isinstance(budget, float):
        if budget == 0:
            return 0
        raise _budget_error(budget, _bare_number(budget))
    if not isinstance(budget, str):
        raise _budget_error(budget, f"expected {BUDGET_FORMS}")
    text = budget.strip()
    if text.lower() == AUTO:
        raise _budget_error(budget, "is chosen from the model's curve: cache.curve.resolve_budget")
    if text.lower() == "all":
        return total_expert_bytes
    if text.startswith("-"):
        raise _budget_error(budget, "is negative")
    share = _SHARE.match(text)
    if share:
        percent = float(share[1])
        if percent > 100:
            raise _budget_error(budget, "a share is at most 100%")
        base = total_expert_bytes if share[2].lower() == "experts" else _ram()
        return int(percent / 100 * base)
    m = _BUDGET.match(text)
    if not m:
        raise _budget_error(budget, f"expected {BUDGET_FORMS}")
    number, unit = float(m[1]), m[2].lower()
    if not unit:
        if number == 0:
            return 0
        raise _budget_error(budget, _bare_number(m[1]))
    scale = SI_UNITS.get(unit) or BINARY_UNITS.get(unit)
    if scale is None:
        if unit in ("k", "m", "g", "t", "ki", "mi", "gi", "ti"):
            p = unit[0].upper() if unit[0] != "k" else "k"
            raise _budget_error(
                budget,
                f"unit {m[2]!r} is ambiguous: write {m[1]}{p}B (x 1000^n bytes) or "
                f"{m[1]}{p.upper()}iB (x 1024^n bytes)",
            )
        raise _budget_error(budget, f"unknown unit {m[2]!r}; expected {BUDGET_FORMS}")
    return int(number * scale)


def _bare_number(number) -> str:
    """Why a number without a unit or a base is refused, and what to write instead."""
    try:
        value = float(number)
    except (TypeError, ValueError):
        value = math.nan
    pct = f"{value * 100:g}" if 0 < value <= 1 else "25"
    size = f"{number}" if value > 1 else "8"
    return (
        f"a number alone names no base: write '{pct}% experts' (of the experts' bytes), "
        f"'{pct}% RAM' (of physical RAM), or a size such as '{size}GB'"
    )


def _ram() -> int:
    return int(psutil.virtual_memory().total)


def share_of_experts(fraction: float) -> str:
    """The budget that keeps ``fraction`` (0..1) of the experts' bytes: ``"25% experts"``."""
    return f"{fraction * 100:g}% experts"
