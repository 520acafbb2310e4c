"""Every load option under one name, resolved once: ``LoadOptions``.

An option given as an argument wins over its ``MOEFLUX_*`` variable, which wins over the
default. This module is the only place that reads the environment for them, and it does so when
options are resolved (``LoadOptions.resolve``), never at import: a variable set after import
still counts. Plain Python: the miss server process imports it without MLX.

    MOEFLUX_EXPERT_IO            expert_io       auto | mmap | pread
    MOEFLUX_BACKEND              backend         auto | ops | metal | cuda
    MOEFLUX_DEVICE_TABLE         device_table    0/off/false | 1/on/true (unset: where CUDA is)
    MOEFLUX_SLOT_WRITES          slot_writes     host | device (unset: by the device)
    MOEFLUX_WAIT_TIMEOUT_S       wait_timeout_s  how long the GPU waits for the miss server
    MOEFLUX_SERVER_POLL_US       server_poll_us  the miss server's poll interval after a request
    MOEFLUX_SERVER_POLL_MAX_US   server_poll_max_us  ... growing to this while no request comes
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Optional, Union

import psutil

IO_MODES = ("auto", "mmap", "pread")
BACKENDS = ("auto", "ops", "metal", "cuda")
SLOT_WRITES = ("host", "device")
DEFAULT_RAM_FRACTION = (
    0.4  # of physical RAM: the cache budget when none is given and the experts do not fit
)

Budget = Union[None, int, float, str]

_TRUE, _FALSE = ("1", "on", "true"), ("0", "off", "false")


def _switch(text: str) -> Optional[bool]:
    text = text.strip().lower()
    return True if text in _TRUE else False if text in _FALSE else None


def _choice(allowed):
    return lambda text: text if text in allowed else None


# option -> (variable, parser of its text; None from a parser: the variable is ignored)
ENVIRONMENT = {
    "expert_io": ("MOEFLUX_EXPERT_IO", str),  # select_expert_io warns about a bad value
    "backend": ("MOEFLUX_BACKEND", str),  # select_backend rejects a bad value
    "device_table": ("MOEFLUX_DEVICE_TABLE", _switch),
    "slot_writes": ("MOEFLUX_SLOT_WRITES", _choice(SLOT_WRITES)),
    "wait_timeout_s": ("MOEFLUX_WAIT_TIMEOUT_S", float),
    "server_poll_us": ("MOEFLUX_SERVER_POLL_US", float),
    "server_poll_max_us": ("MOEFLUX_SERVER_POLL_MAX_US", float),
}


@dataclass(frozen=True)
class LoadOptions:
    """How a model's experts are streamed: what ``moeflux_mlx.load`` and ``patch_model`` take.

    Attributes:
        expert_io: ``auto`` (the RAM gate: ``pread`` when the experts exceed 0.75 x RAM, else
            ``mmap``), ``mmap`` or ``pread``.
        backend: ``auto`` (Metal kernels on Metal, CUDA kernels on CUDA, MLX ops on the CPU),
            ``ops``, ``metal`` or ``cuda``.
        cache_budget: MLX memory for resident experts: bytes, ``"8GB"``, a fraction of RAM,
            ``"all"``, or 0 for none; None: every expert when they fit in 0.4 x RAM, else 0.4 x RAM.
        prefetch: read the experts that the next layer's router predicts in the background.
        threads: parallel reads of the ``pread`` store.
        device_table: CUDA: decode looks slots up on the GPU (the device-side table); None: on
            wherever it can run.
        slot_writes: ``host`` (into the pool's memory through a host view) or ``device`` (through
            host staging and a GPU scatter); None: ``device`` on CUDA, else ``host``.
        wait_timeout_s: how long the GPU waits for the miss server before it gives up.
        server_poll_us, server_poll_max_us: the miss server's poll interval after a request, and
            the cap it grows to while no request comes.
        table_every_layer: benchmarks only: fully cached layers are looked up through the
            device-side table too, to measure what the lookup itself costs.
    """

    expert_io: str = "auto"
    backend: str = "auto"
    cache_budget: Budget = None
    prefetch: bool = False
    threads: int = 8
    device_table: Optional[bool] = None
    slot_writes: Optional[str] = None
    wait_timeout_s: float = 60.0
    server_poll_us: float = 20.0
    server_poll_max_us: float = 1000.0
    table_every_layer: bool = False

    @classmethod
    def resolve(cls, **given) -> LoadOptions:
        """Options from the arguments ``given`` (None: not given), then the environment.

        Args:
            **given: any field of ``LoadOptions``.

        Returns:
            The resolved options.

        Raises:
            TypeError: an argument that is not a load option.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"unknown load option(s): {', '.join(unknown)}")
        values = from_environment()
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)

    def source(self, name: str, given: Optional[dict] = None) -> str:
        """Where option ``name`` came from, for messages: its flag, its variable or the default."""
        if given and given.get(name) is not None:
            return "--" + name.replace("_", "-")
        var = ENVIRONMENT.get(name, (None,))[0]
        if var and os.environ.get(var):
            return f"{var}={os.environ[var]}"
        return "default"


def from_environment() -> dict:
    """The load options set by ``MOEFLUX_*`` variables (unset or unparsable ones left out)."""
    out = {}
    for name, (var, parse) in ENVIRONMENT.items():
        text = os.environ.get(var)
        if not text:
            continue
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is not None:
            out[name] = value
    return out


_SIZE = re.compile(r"^\s*([\d.]+)\s*([kmgt]?i?b?)?\s*$", re.I)


def parse_budget(budget: Budget, total_expert_bytes: int) -> int:
    """Bytes of a cache budget.

    Args:
        budget: ``8GB`` / ``512MiB`` (binary units), a number of bytes, a fraction of RAM (a float
            in (0, 1]), ``"all"`` (every expert), or None: every expert when they fit in 0.4 x
            RAM, else 0.4 x RAM.
        total_expert_bytes: the model's expert bytes (for ``"all"`` and None).

    Returns:
        The budget in bytes.

    Raises:
        ValueError: not a budget.
    """
    ram = psutil.virtual_memory().total
    if budget is None:
        return int(min(total_expert_bytes, DEFAULT_RAM_FRACTION * ram))
    if isinstance(budget, str):
        if budget.strip().lower() == "all":
            return total_expert_bytes
        m = _SIZE.match(budget)
        if not m:
            raise ValueError(f"cache budget {budget!r}: expected e.g. 8GB, 512MiB, 0.25 or all")
        unit = (m[2] or "").lower().rstrip("b").rstrip("i")
        if unit:
            return int(float(m[1]) * 1024 ** " kmgt".index(unit))
        budget = float(m[1]) if "." in m[1] else int(m[1])
    if budget < 0:
        raise ValueError(f"cache budget {budget!r} is negative")
    if isinstance(budget, float) and budget <= 1:
        return int(budget * ram)
    return int(budget)
