"""Every load option under one name, resolved once: ``LoadOptions``.

An option given as an argument wins over its ``MOEFLUX_*`` variable, which wins over the
default. This module is the only place that reads the environment for them, and it does so when
options are resolved (``LoadOptions.resolve``), never at import: a variable set after import
still counts. Values are read case-insensitively; a bad value (argument or variable) raises
``OptionError`` naming it, e.g. ``MOEFLUX_EXPERT_IO=banana: expected one of auto, mmap, pread, direct``.
Plain Python: the miss server process imports it without MLX.

    MOEFLUX_EXPERT_IO            expert_io       auto | mmap | pread | direct
    MOEFLUX_BACKEND              backend         auto | ops | metal | cuda
    MOEFLUX_DEVICE_TABLE         device_table    0/off/false/no | 1/on/true/yes (unset: where CUDA is)
    MOEFLUX_SLOT_WRITES          slot_writes     host | device (unset: by the device)
    MOEFLUX_EVICTION             eviction        lru | lfu | lfuda | decay | transition | logistic
                                                 | s3fifo
    MOEFLUX_THREADS              threads         parallel reads of the pread store (>= 1)
    MOEFLUX_WARM_READ_THREADS    warm_read_threads   ... of a few experts the page cache holds
                                                     (0: every thread)
    MOEFLUX_WAIT_TIMEOUT_S       wait_timeout_s  how long the GPU waits for the miss server (> 0)
    MOEFLUX_SERVER_POLL_US       server_poll_us  the miss server's poll interval after a request
    MOEFLUX_SERVER_POLL_MAX_US   server_poll_max_us  ... growing to this while no request comes
    MOEFLUX_PREFILL_WHOLE_LAYER  prefill_whole_layer  rows per expert from which a prefill reads its
                                                      whole layer without a host sync (0: never)
    MOEFLUX_PREFILL_READ_AHEAD   prefill_read_ahead   0/off | 1/on (default): such a prefill reads
                                                      the next layer while this one computes
    MOEFLUX_PREFILL_DMA          prefill_dma          0/off (default) | 1/on: on CUDA such a prefill
                                                      uploads its layers on the copy engines
    MOEFLUX_PREFILL_WARM_SLOTS   prefill_warm_slots   0/off (default) | 1/on: such a prefill leaves
                                                      the experts it routed most in the slots
    MOEFLUX_PREFILL_LEARNS       prefill_learns       0/off | 1/on (default): the eviction policy
                                                      learns from such a prefill's routing
    MOEFLUX_PIN_EXPERTS          pin_experts     0/off (default) | 1/on: CUDA: the GPU copies
                                                 missed experts out of the page-locked files

Cache budgets (``parse_budget``): ``"all"``, ``0``, a fraction of RAM in (0, 1] (``0.25``), or a
size with a unit: ``B``, SI ``kB`` ``MB`` ``GB`` ``TB`` (powers of 1000) or binary ``KiB`` ``MiB``
``GiB`` ``TiB`` (powers of 1024); from Python also an ``int`` of bytes. Anything else (``1.5``,
``8G``, ``-5GB``) is an ``OptionError``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import psutil

from .errors import OptionError

IO_MODES = ("auto", "mmap", "pread", "direct")
BACKENDS = ("auto", "ops", "metal", "cuda")
SLOT_WRITES = ("host", "device")
EVICTIONS = (
    "lru",
    "lfu",
    "lfuda",
    "decay",
    "transition",
    "logistic",
    "s3fifo",
)  # cache.policy.POLICIES
DEFAULT_RAM_FRACTION = (
    0.4  # of physical RAM: the cache budget when none is given and the experts do not fit
)

Budget = Union[None, int, float, str]

_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _switch(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


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


def _number(minimum: float, strict_minimum: bool) -> Callable[[str], float]:
    def parse(text) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            value = math.nan
        ok = value > minimum if strict_minimum else value >= minimum
        if not (ok and math.isfinite(value)):
            raise ValueError(f"expected a number {'>' if strict_minimum else '>='} {minimum:g}")
        return value

    return parse


# option -> (variable, parser of its text: the value, or ValueError saying what it expects)
ENVIRONMENT: Dict[str, Tuple[str, Callable[[str], Any]]] = {
    # lenient: select_expert_io reads the variable itself and warns about a bad value
    "expert_io": ("MOEFLUX_EXPERT_IO", _Choice(IO_MODES, lenient=True)),
    "backend": ("MOEFLUX_BACKEND", _Choice(BACKENDS)),
    "device_table": ("MOEFLUX_DEVICE_TABLE", _switch),
    "slot_writes": ("MOEFLUX_SLOT_WRITES", _Choice(SLOT_WRITES)),
    "eviction": ("MOEFLUX_EVICTION", _Choice(EVICTIONS)),
    "threads": ("MOEFLUX_THREADS", lambda text: _positive_int(_whole_number(text))),
    "warm_read_threads": (
        "MOEFLUX_WARM_READ_THREADS",
        lambda text: _count(_whole_number(text, minimum=0)),
    ),
    "wait_timeout_s": ("MOEFLUX_WAIT_TIMEOUT_S", _number(0, strict_minimum=True)),
    "server_poll_us": ("MOEFLUX_SERVER_POLL_US", _number(0, strict_minimum=False)),
    "server_poll_max_us": ("MOEFLUX_SERVER_POLL_MAX_US", _number(0, strict_minimum=False)),
    "prefill_whole_layer": ("MOEFLUX_PREFILL_WHOLE_LAYER", _number(0, strict_minimum=False)),
    "prefill_read_ahead": ("MOEFLUX_PREFILL_READ_AHEAD", _switch),
    "prefill_dma": ("MOEFLUX_PREFILL_DMA", _switch),
    "prefill_warm_slots": ("MOEFLUX_PREFILL_WARM_SLOTS", _switch),
    "prefill_learns": ("MOEFLUX_PREFILL_LEARNS", _switch),
    "pin_experts": ("MOEFLUX_PIN_EXPERTS", _switch),
}
# a call routing at least this many (token, expert) rows per expert of its layer names nearly
# every expert (1 - e^-4 = 98% at uniform routing): reading the whole layer costs few extra bytes
DEFAULT_PREFILL_WHOLE_LAYER = 4.0


def _whole_number(text: str, minimum: int = 1) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"expected a whole number >= {minimum}") from None


def _positive_int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("expected a whole number >= 1")
    return value


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("expected a whole number >= 0")
    return value


def _check_budget(value) -> Budget:
    parse_budget(value, 0)  # raises OptionError
    return value


# what an argument given to ``resolve`` must be: option -> checker returning the value to use
_ARGUMENTS: Dict[str, Callable[[Any], Any]] = {
    "expert_io": ENVIRONMENT["expert_io"][1],
    "backend": ENVIRONMENT["backend"][1],
    "slot_writes": ENVIRONMENT["slot_writes"][1],
    "eviction": ENVIRONMENT["eviction"][1],
    "threads": _positive_int,
    "warm_read_threads": _count,
    "cache_budget": _check_budget,
    "wait_timeout_s": ENVIRONMENT["wait_timeout_s"][1],
    "server_poll_us": ENVIRONMENT["server_poll_us"][1],
    "server_poll_max_us": ENVIRONMENT["server_poll_max_us"][1],
    "prefill_whole_layer": ENVIRONMENT["prefill_whole_layer"][1],
}


# parallel expert reads: the cores, from 8 to 16. A prefill's whole-layer reads from the page cache
# run faster on 16 threads than on 8 where the cores are there, and decode's few experts a layer
# read no slower (docs/benchmarks.md, "Prefill")
DEFAULT_THREADS = min(16, max(8, os.cpu_count() or 8))
# From the page cache, a call of a few experts (a decode step's misses) is bound by its calls,
# not its copying, and reads fastest on a few threads (docs/benchmarks.md, "Prefill"), while
# a cold disk serves it faster on every thread
DEFAULT_WARM_READ_THREADS = 4


@dataclass(frozen=True)
class LoadOptions:
    """How a model's experts are streamed: what ``moeflux_mlx.load`` and ``patch_model`` take.

    Attributes:
        expert_io: ``auto`` (the RAM gate: ``pread`` when the experts exceed 0.75 x RAM, else
            ``mmap``), ``mmap``, ``pread``, or ``direct`` (``pread`` bypassing the page cache:
            faster cold reads, no reuse of what the cache held; never chosen by the gate).
        backend: ``auto`` (Metal kernels on Metal, CUDA kernels on CUDA, MLX ops on the CPU),
            ``ops``, ``metal`` or ``cuda``.
        cache_budget: MLX memory for resident experts: bytes, ``"8GB"``, a fraction of RAM,
            ``"all"``, or 0 for none; None: every expert when they fit in 0.4 x RAM, else 0.4 x RAM.
        prefetch: read the experts that the next layer's router predicts in the background.
        threads: parallel reads of the ``pread`` store.
        warm_read_threads: a ``pread`` call of a few experts (at most 32 MiB) that the page
            cache holds, as a few pages of each asked without reading tell (``RWF_NOWAIT``,
            Linux), is read on this many threads instead of ``threads``; 0: always ``threads``.
        device_table: CUDA: decode looks slots up on the GPU (the device-side table); None: on
            wherever it can run.
        slot_writes: ``host`` (into the pool's memory through a host view) or ``device`` (through
            host staging and a GPU scatter); None: ``device`` on CUDA, else ``host``.
        eviction: which resident expert a miss replaces (``cache.policy``): ``transition``
            (default: decayed use counts plus what tends to follow the call), ``logistic``
            (that plus an online model of the next two calls), ``decay``, ``lru``, ``lfu``,
            ``lfuda`` or ``s3fifo``; the device-side table's miss server keeps
            its layers by the same policy.
        wait_timeout_s: how long the GPU waits for the miss server before it gives up.
        server_poll_us, server_poll_max_us: the miss server's poll interval after a request, and
            the cap it grows to while no request comes.
        prefill_whole_layer: a call on a layer with fewer slots than experts (a prefill at a
            small budget) that routes at least this many (token, expert) rows per expert of the
            layer reads the whole layer into a pool of its own and computes from it without a
            host sync, so the model's graph stays lazy as stock mlx-lm's (the last layer's
            unused outputs are never computed) and each layer's reads overlap the previous
            layer's computation; 0: never (one host sync per call, only the routed experts).
        prefill_read_ahead: such a prefill starts reading the next layer as soon as a layer's
            read is taken, in the background, so the reads run back to back while the device
            computes (a layer is read ahead only while it takes at most a quarter of the
            memory available).
        prefill_dma: with device slot writes (CUDA), such a prefill's layers are read into
            page-locked memory and copied to the device by the GPU's copy engines, piece by
            piece as they are read, beside the computation; off (the default: slower so far,
            docs/benchmarks.md "Prefill"): a copy kernel reads them out of mapped host staging,
            on the GPU's cores.
        prefill_warm_slots: once each layer of such a prefill has computed, the layer's slots
            take the experts its rows routed most, copied from its whole-layer pool (no read):
            the prompt's last token and the first generated ones, which mlx-lm decodes one at a
            time, then find some of theirs resident. Off (the default): on a GPU the refill cost
            more than the reads it saved (docs/benchmarks.md, "Prefill").
        prefill_learns: once each layer of such a prefill has computed, the layer's eviction
            policy learns from the routing of its latest rows (``EvictionPolicy.observe``: use
            counts, what follows what; the slots stay as they are), so that a learning policy
            (``transition``, ``logistic``) starts the decode knowing the prompt's routing
            instead of learning it from the first generated tokens. On by default.
        pin_experts: CUDA, device-side table: the expert files are mapped and page-locked in
            host RAM for the GPU (``cudaHostRegister``, read-only), and the GPU copies each
            missed expert straight out of them: the miss server picks its slot but reads
            nothing. The files stay in RAM while the model is loaded, so they must fit in 0.75
            x RAM. Off (the default): the miss server reads misses into staging.
        table_every_layer: benchmarks only: fully cached layers are looked up through the
            device-side table too, to measure what the lookup itself costs.
    """

    expert_io: str = "auto"
    backend: str = "auto"
    cache_budget: Budget = None
    prefetch: bool = False
    threads: int = DEFAULT_THREADS
    warm_read_threads: int = DEFAULT_WARM_READ_THREADS
    device_table: Optional[bool] = None
    slot_writes: Optional[str] = None
    eviction: str = "transition"
    wait_timeout_s: float = 60.0
    server_poll_us: float = 20.0
    server_poll_max_us: float = 1000.0
    prefill_whole_layer: float = DEFAULT_PREFILL_WHOLE_LAYER
    prefill_read_ahead: bool = True
    prefill_dma: bool = False
    prefill_warm_slots: bool = False
    prefill_learns: bool = True
    pin_experts: bool = False
    table_every_layer: bool = False

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
BUDGET_FORMS = "a size with a unit (8GB, 512MiB), a fraction of RAM in (0, 1] (0.25), all, or 0"


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
        budget: ``"all"`` (every expert); ``0`` (none); a fraction of RAM in (0, 1] (a float, or
            a string such as ``"0.25"``); a size with a unit (``"8GB"`` = 8 x 1000^3 bytes,
            ``"8GiB"`` = 8 x 1024^3, also B, kB, MB, TB, KiB, MiB, TiB; case-insensitive); an
            ``int`` of bytes; or None: every expert when they fit in 0.4 x RAM, else 0.4 x RAM.
        total_expert_bytes: the model's expert bytes (for ``"all"`` and None).

    Returns:
        The budget in bytes.

    Raises:
        OptionError (a ValueError): not a budget, e.g. ``1.5`` (neither a fraction nor a size:
            write 1.5GB), ``8G`` (which G?), a negative number.
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
        return _fraction(budget, budget)
    if not isinstance(budget, str):
        raise _budget_error(budget, f"expected {BUDGET_FORMS}")
    text = budget.strip()
    if text.lower() == "all":
        return total_expert_bytes
    if text.startswith("-"):
        raise _budget_error(budget, "is negative")
    m = _BUDGET.match(text)
    if not m:
        raise _budget_error(budget, f"expected {BUDGET_FORMS}")
    number, unit = float(m[1]), m[2].lower()
    if not unit:
        if number == 0:
            return 0
        if number > 1:
            raise _budget_error(
                budget,
                "a number without a unit is a fraction of RAM, in (0, 1]; for a size add a "
                f"unit: {m[1]}GB (x 1000^3 bytes) or {m[1]}GiB (x 1024^3 bytes)",
            )
        return _fraction(number, budget)
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


def _fraction(value: float, budget: Budget) -> int:
    if not math.isfinite(value) or value < 0:
        raise _budget_error(budget, "is negative" if value < 0 else f"expected {BUDGET_FORMS}")
    if value == 0:
        return 0
    if value > 1:
        raise _budget_error(
            budget,
            "a float is a fraction of RAM, in (0, 1]; for bytes pass an int or a size "
            "with a unit such as '8GB'",
        )
    return int(value * psutil.virtual_memory().total)
