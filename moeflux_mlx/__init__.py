"""moeflux-mlx: streaming-experts Mixture-of-Experts inference for MLX.

Data path, one package per step: ``format`` (expert files on disk) -> ``io`` (reading them) ->
``cache`` (slots in MLX memory) -> ``compute`` (the expert computation) -> ``model`` (the drop-in
for mlx-lm's ``SwitchGLU``, ``load``, ``patch_model``); ``cuda`` is the optional device-side
table behind the cache interface; ``commands`` are the ``moeflux-mlx`` CLI; ``options`` carries
every load option. See docs/architecture.md.

The names of ``model.load`` are imported on first use, so that a part that needs no MLX (the
miss server process, ``cuda.miss_server``) can import the package without loading MLX.
"""

import importlib

from .errors import (
    CheckpointError,
    ConvertError,
    CurveError,
    DeviceCopyError,
    DeviceSetupError,
    DeviceWaitError,
    ExpertFileError,
    ExpertIndexError,
    ExpertReadError,
    LayoutError,
    ModelClosedError,
    MoefluxError,
    OptionError,
    SafetensorsHeaderError,
    UnsupportedQuantizationError,
)
from .format.convert import convert, verify_conversion
from .io.store import select_expert_io
from .options import LoadOptions

__version__ = "0.1.0"

_LAZY = {name: "model.load" for name in ("load", "patch_model", "reset_stats", "stats")}
_LAZY["StreamingRuntime"] = "model.runtime"
_LAZY["sharded_load"] = "model.sharded"

__all__ = [
    "load",
    "sharded_load",
    "patch_model",
    "stats",
    "reset_stats",
    "convert",
    "verify_conversion",
    "select_expert_io",
    "LoadOptions",
    "StreamingRuntime",
    "MoefluxError",
    "CheckpointError",
    "ConvertError",
    "CurveError",
    "SafetensorsHeaderError",
    "UnsupportedQuantizationError",
    "LayoutError",
    "ExpertFileError",
    "ExpertReadError",
    "ExpertIndexError",
    "ModelClosedError",
    "DeviceWaitError",
    "DeviceSetupError",
    "DeviceCopyError",
    "OptionError",
]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'moeflux_mlx' has no attribute {name!r}")
    mod = importlib.import_module(f".{module}", __name__)
    for other, where in _LAZY.items():  # bind every name of that module at once
        if where == module:
            globals()[other] = getattr(mod, other)
    return globals()[name]


def __dir__():
    return sorted(set(globals()) | set(__all__))
