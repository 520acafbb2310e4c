"""moeflux-mlx: streaming-experts Mixture-of-Experts inference for MLX.

Data path: files (``convert``) -> store (``store``) -> cache (``cache``) -> kernels
(``backends``, ``kernels``) -> module (``module``), assembled by ``load`` / ``patch_model``.
"""

from .convert import convert, verify_conversion
from .errors import (CheckpointError, ConvertError, DeviceWaitError, ExpertFileError, ExpertIndexError,
                     ExpertReadError, LayoutError, ModelClosedError, MoefluxError,
                     SafetensorsHeaderError, UnsupportedQuantizationError)
from .loader import StreamingRuntime, load, patch_model, reset_stats, stats
from .store import select_expert_io

__version__ = "0.1.0"

__all__ = [
    "load", "patch_model", "stats", "reset_stats", "convert", "verify_conversion", "select_expert_io",
    "StreamingRuntime", "MoefluxError", "CheckpointError", "ConvertError", "SafetensorsHeaderError",
    "UnsupportedQuantizationError", "LayoutError", "ExpertFileError", "ExpertReadError",
    "ExpertIndexError", "ModelClosedError", "DeviceWaitError",
]
