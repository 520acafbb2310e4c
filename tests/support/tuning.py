"""Load options with a machine setting overridden, for tests and benchmarks: what the machine
decides (``options.Tuning``) is set by no environment variable, only by the options handed to
``moeflux_mlx.load``.

    model, _ = moeflux_mlx.load(path, options=tuned(slot_writes="device"), cache_budget=0)
"""

from __future__ import annotations

import dataclasses

from moeflux_mlx.options import LoadOptions, Tuning

TUNING_FIELDS = frozenset(f.name for f in dataclasses.fields(Tuning))


def tuned(**settings) -> LoadOptions:
    """``LoadOptions`` resolved as ``load`` would (arguments, then ``MOEFLUX_*`` variables,
    then defaults), with ``Tuning`` fields among ``settings`` set on its ``tuning``.

    Args:
        **settings: any ``LoadOptions`` or ``Tuning`` field (None: not given).

    Returns:
        The options.
    """
    machine = {k: v for k, v in settings.items() if k in TUNING_FIELDS and v is not None}
    given = {k: v for k, v in settings.items() if k not in TUNING_FIELDS}
    return LoadOptions.resolve(tuning=Tuning(**machine), **given)
