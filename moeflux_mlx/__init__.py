"""moeflux-mlx: streaming-experts Mixture-of-Experts inference for MLX.

Data path: files (``convert``) -> store (``store``) -> cache (``cache``) -> kernels
(``backends``, ``kernels``) -> module (``module``), assembled by ``load`` / ``patch_model``.

The names of ``loader`` are imported on first use, so that a part that needs no MLX (the miss
server process, ``miss_server.py``) can import the package without loading MLX.
"""

import importlib

from .convert import convert, verify_conversion
from .errors import (CheckpointError, ConvertError, DeviceWaitError, ExpertFileError, ExpertIndexError,
                     ExpertReadError, LayoutError, ModelClosedError, MoefluxError,
                     SafetensorsHeaderError, UnsupportedQuantizationError)

__version__ = "0.1.0"

from .store import select_expert_io

_LAZY = {name: "loader" for name in ("StreamingRuntime", "load", "patch_model", "reset_stats", "stats")}

__all__ = [
    "load", "patch_model", "stats", "reset_stats", "convert", "verify_conversion", "select_expert_io",
    "StreamingRuntime", "MoefluxError", "CheckpointError", "ConvertError", "SafetensorsHeaderError",
    "UnsupportedQuantizationError", "LayoutError", "ExpertFileError", "ExpertReadError",
    "ExpertIndexError", "ModelClosedError", "DeviceWaitError",
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
